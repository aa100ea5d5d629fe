"""Shared harness for the parity suite: float32 everywhere, full-precision matmuls, the same
weights on both sides (copied through the converter), and two tables printed at the end of the
run (and written to $JAXGPT_PARITY_REPORT as {"parity": {...}, "self": {...}} if set).

The comparison helpers (``assert_close``, ``check_module``, ``randomize``, the float64 reference, ...)
are the public parity kit, ``jaxgpt.testing``, re-exported here for the tests; this file keeps what is
pytest's: the compile flags and cache, the skip rules, the markers' hooks, and the tables, filled by
a listener on every comparison the kit makes (``_listen``). The tables:

- parity: the worst error per component of jaxgpt (or torch_ref) against a reference it did not
  compute itself (torch_ref, torch built-ins, Hugging Face, the seeds' code): ``assert_close``;
- self-consistency: the worst error of one implementation against itself (KV cache vs full
  recompute, jit vs eager, scan vs unrolled, round trips): ``assert_self_consistent``.

One tolerance rule: float32 forward 1e-5 max abs; gradients (``assert_grads_close``, and the
gradients in ``check_module``) 1e-5 max abs after dividing by max(1, max|g_ref|) per leaf.

References that live outside the repository (../shared: seed texts, Tiny Shakespeare) are
reached through ``require_shared``: a missing one skips the test locally, and fails it when the
environment variable CI is true (so CI cannot pass by skipping every seed comparison). Optional
packages the tests need (transformers, tokenizers, ...) go through ``require_module``, the same
rule. The only skip CI accepts is a missing accelerator.

The float64 reference (``check_module``, ``assert_as_accurate_as_torch``): two float32 results
of a multi-layer gradient can differ by ~1e-5 through rounding alone, and by how much depends on
the CPU's kernels. So the models' gradients are judged against torch_ref run in float64 on the
same weights and inputs: jaxgpt's float32 error must be <= max(1e-5, K64 x torch_ref float32's
own error against that float64 result; ``jaxgpt.testing.reference``). The measured margins are in
docs/parity-margins.md (``make parity-margins`` regenerates it: JAXGPT_PARITY_MARGINS=<file>).

Speed: JAX's persistent compilation cache is on in the pytest processes (.pytest_cache/jax-cache,
every program cached); the suite runs under pytest-xdist (``make test``), and the tables above
are merged from the workers. XLA:CPU compiles the tests' programs with LLVM at -O0 and without
its expensive passes (``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes``):
the suite is mostly compilation (in test_train.py's loss curves, 27 of 48 s compiling, 10 tracing),
a test checks numbers and behaviour, not speed, and neither setting changes IEEE float semantics
(no fast-math). -O0 cut a cold run of test_attnres.py + test_train.py from 125 to 92 s, the second
flag test_train.py's loss curves from 46-51 to 37-41 s (2026-11-27, one process, A B A B).
With jaxlib 0.10 they also use XLA:CPU's older fusion emitters (``--xla_cpu_use_fusion_emitters=false``):
test_train.py + test_attention.py cold 152/148 -> 95/98 s, the fast tier cold 514 -> 320 s (2026-11-27).
Tests marked ``same_bits`` (two different programs, equal bit for bit as XLA compiles by default) then run
in a fresh pytest process compiled as users compile (JAXGPT_TEST_XLA_OPT=default, no test-only flag);
JAXGPT_TEST_FUSION_EMITTERS=default turns the emitters flag off.
JAXGPT_TEST_XLA_OPT=default compiles as users do (``make test``'s second pass over the tests marked
``users_flags``, ``make parity-margins`` and ``make test-gpu`` do);
so do the fresh-interpreter checks of the device-count flags.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

# The compile flags of every test process: this one (set before JAX starts, see the docstring), the commands it
# runs (inherited), and the workers that set XLA_FLAGS themselves (sharding, multi-host: ``xla_flags``).
TEST_XLA_FLAGS = "" if os.environ.get("JAXGPT_TEST_XLA_OPT", "0") == "default" else (
    f"--xla_backend_optimization_level={os.environ.get('JAXGPT_TEST_XLA_OPT', '0')} "
    "--xla_llvm_disable_expensive_passes=true")
# XLA:CPU's older fusion emitters compile about a third faster than its MLIR ones (the docstring). An XLA that does
# not know the flag aborts the process, so it is set only for the jaxlib it was verified with.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if (TEST_XLA_FLAGS and os.environ.get("JAXGPT_TEST_FUSION_EMITTERS") != "default"
        and importlib.metadata.version("jaxlib").startswith("0.10.")):
    TEST_XLA_FLAGS += f" {LEGACY_EMITTERS}"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once, if imported again as parity_tests.conftest
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# One CPU device per core, as the jaxgpt command and fit give a user: the sharded and multi-device tests use them
from jaxgpt import use_host_devices  # noqa: E402 - after the setup above, which must run first

use_host_devices()

import jax  # noqa: E402 - after the setup above, which must run first
import numpy as np  # noqa: E402 - after the setup above, which must run first
import pytest  # noqa: E402 - after the setup above, which must run first


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a worker process that picks its own (a device count): the tests' compile flags too."""
    return " ".join((TEST_XLA_FLAGS, *flags)).strip()


# No JAX-wide matmul precision: on a GPU, float32 parity at 1e-5 is the library's own policy
# (ModelConfig.matmul_precision='auto': full float32 for float32 compute; jaxgpt/nn/precision.py).
# Tests marked cpu_only hold only on the CPU backend (its C++ kernels, no cuDNN): skipped elsewhere.


# Compiled as users compile, in make test's second pass (JAXGPT_TEST_XLA_OPT=default): the tests judged against a
# float64 reference (their margins are meant for the programs users run) and the serving engine's programs.
USERS_FLAGS_FILES = ("test_norms.py", "test_mlp.py", "test_attention.py", "test_block.py", "test_decoder.py",
                     "test_bert.py", "test_encdec.py", "test_attnres.py")
USERS_FLAGS_WHOLE = ("test_engine.py", "test_panel_head.py")


def users_flags(item) -> bool:
    name = item.path.name
    return name in USERS_FLAGS_WHOLE or (name in USERS_FLAGS_FILES and "torch_ref" in item.name)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if users_flags(item):
            item.add_marker(pytest.mark.users_flags)
    if jax.default_backend() == "cpu":
        return
    skip = pytest.mark.skip(reason=f"{ACCELERATOR_SKIP} cpu_only: holds on the CPU backend only "
                                   f"(this run: {jax.default_backend()})")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


# Persistent compilation cache (a second run loads the compiled programs instead of compiling them),
# with the commands' settings (jaxgpt.cli.compile_cache): every program cached, however fast it
# compiled, and no size cap (with one, JAX locks and scans the folder on every write, which made a cold
# `make test` 1.9x slower: 1464 s against 787 s with the cache off).
# Unlocked, two xdist workers may race on one entry; JAX then warns and compiles instead (a read
# error is never fatal). JAXGPT_TEST_JAX_CACHE=off turns it off. Only this process uses it: the
# subprocesses the tests start do not (JAX writes an entry in place, so a test that SIGKILLs a run
# could leave a truncated one behind).
from jaxgpt.cli import compile_cache  # noqa: E402 - after the setup above, which must run first

compile_cache.enable(os.environ.get("JAXGPT_TEST_JAX_CACHE",
                                    str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-cache")))
# ...and the commands the tests start keep out of the user's cache (jaxgpt.cli.compile_cache)
os.environ["JAXGPT_COMPILE_CACHE"] = "off"
# Kernel choices do not depend on a timing taken while other tests load the cores: every kernel runs
# where it can (jaxgpt/nn/kernels/calibrate.py; test_calibrate.py tests the measured choice itself)
os.environ.setdefault("JAXGPT_CALIBRATION", "off")

import torch  # noqa: E402 - after the setup above, which must run first

# The helpers live in the public parity kit, jaxgpt.testing; the tests import them from here, where this
# harness's report listens to every comparison they make (_listen, below).
from jaxgpt.testing import (K64, TOL, add_listener, assert_as_accurate_as_torch, assert_close,  # noqa: E402, F401
                            assert_grads_close, assert_self_consistent, check_module, float64_module, float64_torch,
                            grads_err, load_into, max_err, random_params, randomize, record, set_seed_offset,
                            to_float64, to_np, torch_grads)
from jaxgpt.testing import Comparison, Float64Comparison  # noqa: E402 - after the setup above, which must run first

torch.set_default_dtype(torch.float32)
from scripts.harness import SHARED  # noqa: E402  (the one rule for ../shared: $JAXGPT_SHARED, beside the clone)
KINDS = {"parity": "parity: worst max-abs error vs an independent reference, per component",
         "self": "self-consistency: worst max-abs error of an implementation vs itself, per check"}
WORST: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in KINDS}
TOLS: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}  # shown where a row's bound is not TOL
MARGINS: dict[str, dict[str, float]] = {}  # component -> worst direct / jaxgpt / torch error, ratio, bound (float64)


def _listen(event) -> None:
    """Fold one comparison of jaxgpt.testing into the tables printed at the end of the run."""
    if isinstance(event, Comparison):
        WORST[event.kind][event.component] = max(WORST[event.kind][event.component], event.err)
        TOLS[event.kind][event.component] = max(TOLS[event.kind].get(event.component, event.tol), event.tol)
    elif isinstance(event, Float64Comparison):
        e = event
        m = MARGINS.setdefault(e.component, dict(direct=0.0, jaxgpt=0.0, torch=0.0, ratio=0.0, ratios=[],
                                                 headroom=np.inf, direct_headroom=np.inf if e.direct_asserted else 0.0,
                                                 k=e.k))
        m.update(direct=max(m["direct"], e.direct), jaxgpt=max(m["jaxgpt"], e.jaxgpt), torch=max(m["torch"], e.torch),
                 ratio=max(m["ratio"], e.jaxgpt / max(e.torch, 1e-30) if e.jaxgpt > e.tol else 0.0),
                 ratios=m["ratios"] + [e.jaxgpt / max(e.torch, 1e-30)],
                 headroom=min(m["headroom"], e.bound / max(e.jaxgpt, 1e-30)))
        if e.direct_asserted:
            m["direct_headroom"] = min(m["direct_headroom"], e.tol / max(e.direct, 1e-30))


add_listener(_listen)  # once per import of this file (pytest's; a test's `import parity_tests.conftest` adds its own)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# The one skip CI accepts: a test that needs an accelerator it does not have, or the CPU backend it
# is not on. Every such skip reason starts with this; under CI=true any other skip (no C++ compiler
# for the CPU kernels, one host device, ...) is reported as a failure, since it would hide one.
ACCELERATOR_SKIP = "accelerator:"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``same_bits`` test compares two different programs bit for bit (a loop of steps against one-step calls),
    which holds as XLA compiles by default, not with the tests' compile flags: it runs in a fresh pytest
    process compiled as users compile (no test-only XLA flag), and passes or fails with it."""
    if not (pyfuncitem.get_closest_marker("same_bits") and TEST_XLA_FLAGS):
        return None
    import sys

    env = dict(os.environ, JAXGPT_TEST_XLA_OPT="default",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip())
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid}, run with XLA's default fusion emitters, failed:\n{r.stdout[-6000:]}"
                    f"{r.stderr[-2000:]}", pytrace=False)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and on_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(ACCELERATOR_SKIP):
            report.outcome = "failed"
            report.longrepr = (f"CI=true: a skip hides a failure here; only '{ACCELERATOR_SKIP} ...' skips are "
                               f"accepted (parity_tests/conftest.py). The skip: {reason}")


def require_shared(path: Path, what: str = "reference") -> Path:
    """``path`` (under ../shared) if it exists; otherwise skip the test, or fail it under CI=true."""
    path = Path(path)
    if not path.exists():
        msg = f"{what} {path} is missing (the shared folder beside the clone, {SHARED}, is not there or incomplete)"
        if on_ci():
            pytest.fail(msg + "; CI=true, so a missing reference is an error, not a skip", pytrace=False)
        pytest.skip(msg)
    return path


def require_module(name: str, allow_module_level: bool = False):
    """``import name`` (an optional dependency of the tests, in the ``test`` extra); if it is not
    installed, skip the test (or, with ``allow_module_level``, the whole file) locally, and fail it
    under CI=true, where every test dependency is installed and a skip would hide a failure."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        msg = f"{name} is not installed ({e}); pip install -e '.[test]'"
        if on_ci():
            pytest.fail(msg + "; CI=true, so a missing test dependency is an error, not a skip", pytrace=False)
        pytest.skip(msg, allow_module_level=allow_module_level)


# JAXGPT_PARITY_SEED_OFFSET=s: every randomize()d weight drawn from seed + s (0: the suite as committed);
# for measuring the float64 margins at other weights (docs/parity-margins.md), not for CI.
SEED_OFFSET = int(os.environ.get("JAXGPT_PARITY_SEED_OFFSET", "0"))
set_seed_offset(SEED_OFFSET)


def _tables() -> dict:
    return {"worst": {k: dict(v) for k, v in WORST.items()}, "tols": TOLS, "margins": MARGINS}


def _merge(tables: dict) -> None:
    """Fold another process's tables (an xdist worker's; an earlier seed's margins) into this one's."""
    for kind, rows in tables.get("worst", {}).items():
        for k, v in rows.items():
            WORST[kind][k] = max(WORST[kind][k], v)
    for kind, rows in tables.get("tols", {}).items():
        for k, v in rows.items():
            TOLS[kind][k] = max(TOLS[kind].get(k, v), v)
    for k, m in tables.get("margins", {}).items():
        if k not in MARGINS:
            MARGINS[k] = dict(m)
            continue
        old = MARGINS[k]
        old.update({c: max(old[c], m[c]) for c in ("direct", "jaxgpt", "torch", "ratio")},
                   ratios=old["ratios"] + m["ratios"], **{c: min(old[c], m[c]) for c in ("headroom", "direct_headroom")})


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the tables to the controller
        session.config.workeroutput["jaxgpt_tables"] = json.dumps(_tables())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", None) or {}
    if "jaxgpt_tables" in out:
        _merge(json.loads(out["jaxgpt_tables"]))


def machine() -> str:
    """The CPU (lscpu's model name, cores) and the library versions, for the margins file."""
    cpu = platform.processor() or platform.machine()
    try:
        info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                 check=True).stdout.splitlines() if ":" in line)
        flags = set(info.get("Flags", "").split())
        simd = next((f for f in ("avx512f", "avx2", "avx", "neon", "asimd") if f in flags), "")
        cpu = (f"{info['Model name'].strip()}, {info.get('Vendor ID', '?').strip()} family "
               f"{info.get('CPU family', '?').strip()} model {info.get('Model', '?').strip()}"
               f"{', ' + simd if simd else ''} ({info['CPU(s)'].strip()} CPUs, {info['Architecture'].strip()}"
               f"{', ' + info['Hypervisor vendor'].strip() + ' VM' if 'Hypervisor vendor' in info else ''})")
    except (OSError, subprocess.CalledProcessError, KeyError):
        pass
    return (f"{cpu}; jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
            f"numpy {np.__version__}, Python {platform.python_version()}")


def margins_markdown() -> str:
    rows = ["| component | n | jaxgpt f32 vs f64 | torch_ref f32 vs f64 | ratio: median | ratio: worst over 1e-5 | "
            "bound / jaxgpt err | jaxgpt vs torch_ref f32 | 1e-5 / that |", "|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(MARGINS):
        m = MARGINS[k]
        ratio = f"{m['ratio']:.2f}" if m["ratio"] else "-"
        direct = ("not asserted" if not m["direct_headroom"] else "equal" if not m["direct"]
                  else f"{m['direct_headroom']:.1f}")
        rows.append(f"| {k} | {len(m['ratios'])} | {m['jaxgpt']:.2e} | {m['torch']:.2e} | "
                    f"{float(np.median(m['ratios'])):.2f} | {ratio} | {m['headroom']:.1f} | {m['direct']:.2e} | {direct} |")
    return "\n".join(rows)


def write_margins(path: Path) -> None:
    """docs/parity-margins.md. With JAXGPT_PARITY_MARGINS_MERGE=<json>, the rows of earlier runs
    (other JAXGPT_PARITY_SEED_OFFSET values) kept there are merged in first, and the result kept there."""
    seeds = [SEED_OFFSET]
    keep = os.environ.get("JAXGPT_PARITY_MARGINS_MERGE")
    if keep:
        if Path(keep).exists():
            earlier = json.loads(Path(keep).read_text())
            _merge({"margins": earlier["margins"]})
            seeds = sorted(set(earlier["seeds"]) | set(seeds))
        Path(keep).write_text(json.dumps({"margins": MARGINS, "seeds": seeds}))
    over = [(m["ratio"], k) for k, m in MARGINS.items() if m["ratio"]]
    medians = [float(np.median(m["ratios"])) for m in MARGINS.values()]
    worst = (f"the median jaxgpt/torch_ref ratio per component is {min(medians):.2f} to {max(medians):.2f} "
             "(jaxgpt is as accurate as torch_ref), and " + ("none of jaxgpt's errors exceeded 1e-5" if not over else
             "the worst single ratio where jaxgpt's error exceeded 1e-5 is {:.2f} ({})".format(*max(over))))
    listed = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)) \
        else ", ".join(map(str, seeds))
    path.write_text(MARGINS_HEADER.format(machine=machine(), k=K64, tol=TOL, worst=worst, n=len(seeds), seeds=listed)
                    + margins_markdown() + "\n")


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if hasattr(tr.config, "workerinput"):
        return  # an xdist worker: its tables go to the controller (pytest_sessionfinish), which prints them
    for kind, title in KINDS.items():
        rows = WORST[kind]
        if rows:
            tr.section(f"{title} (float32, tolerance {TOL:.0e} unless stated; grads / max(1, max|g|))")
            width = max(len(k) for k in rows)
            for k in sorted(rows):
                bound = TOLS[kind].get(k, TOL)
                tr.write_line(f"{k:<{width}}  {rows[k]:.2e}" + (f"  (tolerance {bound:.1e})" if bound != TOL else ""))
    report = os.environ.get("JAXGPT_PARITY_REPORT")
    if report and any(WORST.values()):
        Path(report).write_text(json.dumps({k: dict(sorted(v.items())) for k, v in WORST.items()}, indent=2) + "\n")
    margins = os.environ.get("JAXGPT_PARITY_MARGINS")
    if margins and MARGINS:
        write_margins(Path(margins))
        tr.write_line(f"float64 margins written to {margins}")


MARGINS_HEADER = """# Parity margins against a float64 reference

Generated by `make parity-margins MARGIN_SEEDS="$(seq 0 19)"`: the float64-referenced parity tests
(`-k torch_ref` in the files listed in the Makefile) with JAXGPT_PARITY_MARGINS set, once per draw
of the random weights (JAXGPT_PARITY_SEED_OFFSET; the suite itself runs offset 0), here {n} draw(s):
offsets {seeds}. parity_tests/conftest.py writes this file. Measured on: {machine}.

Why: two float32 computations of a multi-layer gradient differ by ~1e-5 through rounding alone,
by an amount that depends on the CPU's kernels (issue #18: on a 2-core AMD EPYC, jaxgpt vs
torch_ref on the EncDec seed-like gradients measured 1.003e-05 > 1e-05). So each float32 side is
also compared with torch_ref run in float64 on the same weights and inputs (torch.float64; torch_ref's
`.float()` upcasts are kept from rounding it back to float32, and every submodule is checked to
return float64), and jaxgpt must satisfy

    error(jaxgpt float32 vs float64) <= max({tol:.0e}, K64 x error(torch_ref float32 vs float64)),  K64 = {k:g}

Errors are max abs; outputs as their test states (unit scale, or / max(1, max|ref|)); gradients per
leaf / max(1, max|g_ref|), worst leaf. A row gathers the comparisons under one name (parametrisations
and weight draws). Columns: n, the number of comparisons; jaxgpt's and torch_ref's float32 errors
against float64 (worst); the jaxgpt/torch_ref error ratio, its median and its worst among the
comparisons where jaxgpt's error exceeded 1e-5 (the only ones where K64 matters; "-": none did); the
smallest bound / jaxgpt error (the margin: >= 1 passes); the direct float32-vs-float32 error (worst)
and, where that comparison is asserted at 1e-5 too, its smallest margin 1e-5 / error ("not
asserted": at some draw it came within 2x of 1e-5 through rounding alone, so only the float64 bound
is asserted; "equal": bit-identical).

Over these draws {worst}.

"""


def seed_classes(filename: str, names: list[str]) -> dict:
    """Execute the named top-level classes/functions of a seed document (read from ../shared at
    test time, never copied into the repo) and return its namespace. Skips if it is missing
    (fails under CI=true: ``require_shared``)."""
    import math
    import re

    import torch.nn.functional as F

    path = require_shared(SHARED / "seeds" / filename, "seed file")
    text = path.read_text(encoding="utf-8")
    from dataclasses import dataclass
    from typing import Optional, Tuple

    ns = {"torch": torch, "nn": torch.nn, "F": F, "math": math, "np": np, "dataclass": dataclass,
          "Optional": Optional, "Tuple": Tuple, "Tensor": torch.Tensor}
    for name in names:
        starts = [m.start() for m in re.finditer(rf"^(?:@\w+\n)*(class|def) {name}\b", text, re.M)]
        assert starts, f"{name} not found in {filename}"
        lines = text[starts[-1]:].splitlines()
        n = 1
        while n < len(lines) and (not lines[n].strip() or lines[n][0] in " \t" or lines[n - 1].startswith("@")):
            n += 1  # the next unindented line ends the definition
        exec("\n".join(lines[:n]), ns)
    return ns


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def scratch_tables(monkeypatch):
    """Empty report tables for a test that probes the harness or fails comparisons on purpose (the run's
    own tables stay untouched). Returns this module, whose tables the listener then fills."""
    import sys

    here = sys.modules[__name__]
    monkeypatch.setattr(here, "WORST", {kind: defaultdict(float) for kind in KINDS})
    monkeypatch.setattr(here, "TOLS", {kind: {} for kind in KINDS})
    monkeypatch.setattr(here, "MARGINS", {})
    return here
