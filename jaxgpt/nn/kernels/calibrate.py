"""Per-machine choices of the CPU kernels' ``auto`` rules, measured once and cached on disk.

Whether a kernel beats XLA's op can depend on the CPU, not only on the shapes: the decode-step
matvec kernel (cpu/matvec.cc) sped up batch-1 decoding on the AVX-512 Xeon it was written on, and
lost to XLA's dot on a 2-core AMD EPYC (docs/performance.md, "On other CPUs"). So
such a rule asks ``decide(name, measure)``: the first call on a machine runs ``measure()`` (a
second or so), which returns whether the kernel wins, and stores the answer in
``$JAXGPT_CACHE/kernels/calibration.json`` under a key of the rule's name, the CPU model, the
kernels' instruction sets, jax's and jaxgpt's versions and the sources of the kernel and of the rule's
measurement; later calls and
later processes read it back. ``JAXGPT_CALIBRATION=off`` skips measuring (every kernel runs where it
can, the rule before calibration; the test suite runs so, for stable programs); ``=redo`` measures
again.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax

from jaxgpt.core.constants import __version__
from jaxgpt.nn.kernels import native

ENV = "JAXGPT_CALIBRATION"
MODES = ("auto", "off", "redo")


def mode() -> str:
    m = os.environ.get(ENV, "auto").lower()
    if m not in MODES:
        raise ValueError(f"{ENV}={m!r} is not one of {MODES}")
    return m


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def key(name: str, sources: tuple[Path, ...]) -> str:
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest()[:16]
    return " | ".join([name, cpu_model(), " ".join(native.isa_flags()), jax.__version__, __version__, digest])


def path() -> Path:
    return native.cache_dir() / "calibration.json"


def _read() -> dict:
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def decide(name: str, sources: tuple[Path, ...], measure: Callable[[], dict]) -> bool:
    """Whether the kernel of rule ``name`` runs: True without measuring when
    calibration is off; else the stored answer for this machine, or ``measure()``'s, stored. ``measure``
    returns {'wins': bool, ...figures}; the figures are kept beside the answer for a person to read.
    ``sources``: the kernel's source and the rule's module: a change to either measures again."""
    m = mode()
    if m == "off":
        return True
    k = key(name, sources)
    table = _read()
    if m == "auto" and k in table:
        return bool(table[k]["wins"])
    # in a thread of its own: a rule is asked while a program is traced, and under a trace JAX would
    # stage the measurement's calls into that program instead of running them (trace state is per thread)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = dict(pool.submit(measure).result())
    table = {**_read(), k: result}  # re-read: another process may have stored its own rule meanwhile
    path().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path().parent, delete=False, suffix=".tmp") as f:
        json.dump(table, f, indent=1)
    os.replace(f.name, path())  # atomic: parallel processes never read half a file
    return bool(result["wins"])


def best_seconds(fn, *args, calls: int = 1, repeats: int = 5) -> float:
    """A rule's timing: seconds a call of ``fn(*args)`` (a jitted function), the best of ``repeats``
    rounds of ``calls`` calls each, after one untimed call (its compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return min(times)


__all__ = ["ENV", "best_seconds", "cpu_model", "decide", "key", "mode", "path"]
