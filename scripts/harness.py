"""What the experiment and benchmark scripts share: paths, worker subprocesses, timing, the float32
matmul peak, one-thread mode, load-average sampling and an HLO text parser.

Scripts run as modules from the repository root (``python -m scripts.experiments.exp_attnres``), so
``scripts`` and ``jaxgpt`` import without touching ``sys.path``. Nothing here imports a framework at
import time: JAX and torch are imported inside the functions that need them, in the process that
runs them (the two frameworks' thread pools interfere in one process, so timings run each in its
own worker: ``spawn``).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from jaxgpt.core.timing import step_times as step_times  # re-exported: the one step timer (jaxgpt bench uses it too); imports no framework

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def _shared() -> Path:
    """The shared folder (seeds, data, references): $JAXGPT_SHARED, else ``shared`` beside the clone,
    else one level further up (a worktree under the clone's folder). The one rule: the tests, the
    benchmarks and the experiments all use this."""
    if os.environ.get("JAXGPT_SHARED"):
        return Path(os.environ["JAXGPT_SHARED"])
    beside = ROOT.parent / "shared"
    return next((d for d in (beside, ROOT.parent.parent / "shared") if d.is_dir()), beside)


SHARED = _shared()

# ---------------------------------------------------------------- instruction sets

ISAS = ("native", "avx2")


def isa_env(isa: str) -> dict[str, str]:
    """Environment variables that cap both frameworks and jaxgpt's kernels at ``isa``, for the worker
    processes of a benchmark: how an AVX-512 machine measures an AVX2 one (issue "every CPU").
    torch: ATen's kernels, oneDNN and MKL; XLA:CPU: --xla_cpu_max_isa; the C++ kernels:
    JAXGPT_KERNEL_ISA (jaxgpt/nn/kernels/native.py). 'native' changes nothing."""
    if isa not in ISAS:
        raise ValueError(f"isa {isa!r} is not one of {ISAS}")
    if isa == "native":
        return {}
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa"))
    return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "XLA_FLAGS": f"{flags} --xla_cpu_max_isa=AVX2".strip(), "JAXGPT_KERNEL_ISA": "avx2"}


# ---------------------------------------------------------------- worker subprocesses

RESULT = "RESULT "


def report(result: Any) -> None:
    """A worker's answer to ``spawn``: one JSON line on stdout."""
    print(RESULT + json.dumps(result), flush=True)


def spawn(module: str, *args, timeout: float | None = None, check: bool = False, env: dict | None = None) -> Any:
    """Run ``python -m module *args`` from the repository root in a fresh interpreter and return what it
    passed to ``report`` (its last RESULT line). A worker that reports nothing: ``{'error': ...}`` with
    the end of its stderr, or RuntimeError with ``check``. Timeouts raise subprocess.TimeoutExpired.
    ``env``: variables set for the worker on top of this process's environment."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
                       env=None if env is None else {**os.environ, **env})
    lines = [line for line in p.stdout.splitlines() if line.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT):])
    if check:
        raise RuntimeError(f"worker {' '.join(cmd[2:5])} exited with {p.returncode}:\n{(p.stderr or p.stdout)[-3000:]}")
    tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
    return {"error": f"{' '.join(map(str, args[:2])) or module} exited with {p.returncode}: " + " | ".join(tail)}


# ---------------------------------------------------------------- timing

def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), its wall time in seconds)."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def best_of(fn: Callable[[], Any], n: int = 5) -> float:
    """The least disturbed of ``n`` calls, seconds (``fn`` warmed up and synchronous)."""
    return min(timed(fn)[1] for _ in range(n))


def median_of(fn: Callable[[], Any], n: int = 3) -> float:
    """Median wall time of ``n`` calls, seconds."""
    return statistics.median(timed(fn)[1] for _ in range(n))


def matmul_peak(framework: str, n: int = 2048, dtype: str = "float32") -> float:
    """n^3 matmul rate in GFLOP/s, best of 5 after a warm-up, in 'jax' (on its default device, in
    ``dtype``) or 'torch' (the CPU, float32)."""
    if framework == "jax":
        import jax

        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
        mm = jax.jit(lambda x, y: x @ y)
        mm(a, a).block_until_ready()
        seconds = best_of(lambda: mm(a, a).block_until_ready())
    elif framework == "torch":
        import torch

        a = torch.randn(n, n)
        a @ a
        seconds = best_of(lambda: a @ a)
    else:
        raise ValueError(f"framework must be 'jax' or 'torch', got {framework!r}")
    return 2 * n ** 3 / seconds / 1e9


def single_thread() -> None:
    """One compute thread per framework; call before either initialises its thread pools."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def write_result(out: str | Path, result: Any, table: str) -> Path:
    """A benchmark's result as OUT (JSON) and its markdown table beside it (OUT with .md); prints the table."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return out


# ---------------------------------------------------------------- load average

BUSY_LOAD = 3.0  # above this 1-minute load average, other jobs competed for the 2 cores


def load_average() -> float:
    return os.getloadavg()[0]


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while a script runs, so its timings say
    whether other jobs shared the cores (a 2-core experiment itself accounts for up to ~2)."""

    def __init__(self, every: float = 15.0):
        super().__init__(daemon=True)
        self.every, self.samples = every, []

    def start(self):
        if not self.is_alive() and not self.samples:
            self.samples.append(load_average())
            super().start()

    def run(self):
        while True:
            time.sleep(self.every)
            self.samples.append(load_average())

    def record(self) -> dict:
        s = self.samples or [load_average()]
        return {"median": round(statistics.median(s), 2), "max": round(max(s), 2), "samples": len(s),
                "quiet": max(s) <= BUSY_LOAD}


def timing_note(record: dict) -> str:
    """How to read a run's timings, from its ``LoadSampler.record()``."""
    r = record
    if r["quiet"]:
        return f"measured on a quiet machine (1-min load average median {r['median']}, max {r['max']})"
    return (f"measured under load (1-min load average median {r['median']}, max {r['max']}: "
            "other jobs shared the 2 CPU cores)")


# ---------------------------------------------------------------- HLO text

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%([\w.\-]+) .*\{\s*$")


def hlo_dims(shape: str) -> list[int]:
    """Dimensions of an HLO shape string ('f32[4,8]{1,0}' -> [4, 8]; the first of a tuple)."""
    m = re.match(r"\(?\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _split_args(rest: str) -> tuple[str, str]:
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse_hlo(text: str) -> dict:
    """Compiled HLO text (``jit(f).lower(...).compile().as_text()``) -> {instruction name: {op, shape,
    args, comp (its computation), calls (computations it calls), op_name (metadata), attrs}}."""
    instrs, comp = {}, None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            name, shape, op, rest = m.groups()
            args, attrs = _split_args(rest)
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", attrs)
            calls += re.findall(r"called_computations=\{([^}]*)\}", attrs)
            opn = re.search(r'op_name="([^"]*)"', attrs)
            instrs[name] = {"op": op, "shape": shape, "args": re.findall(r"%([\w.\-]+)", args), "comp": comp,
                            "calls": [c.strip().lstrip("%") for c in ",".join(calls).split(",") if c.strip()],
                            "op_name": opn.group(1) if opn else "", "attrs": attrs}
            continue
        m = _COMP.match(line)
        if m:
            comp = m.group(2)
    return instrs
