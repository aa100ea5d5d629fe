"""The tests' compile settings, made before JAX starts (the root conftest imports this plugin first).

XLA:CPU compiles the tests' programs with LLVM at -O0 and without its expensive passes
(``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes``), and with jaxlib 0.10 with
its older fusion emitters (``--xla_cpu_use_fusion_emitters=false``): the suite is mostly compilation, a
test checks numbers and behaviour, not speed, and none of these flags changes IEEE float semantics (no
fast-math). What each flag saves is in docs/performance.md ("The test suite's compile flags").

Tests marked ``same_bits`` (two different programs, equal bit for bit as XLA compiles by default) run in
a fresh pytest process compiled as users compile (JAXGPT_TEST_XLA_OPT=default, no test-only flag);
JAXGPT_TEST_FUSION_EMITTERS=default turns the emitters flag off. JAXGPT_TEST_XLA_OPT=default compiles as
users do (``make test``'s second pass over the tests marked ``users_flags``, ``make parity-margins`` and
``make test-gpu`` do); so do the fresh-interpreter checks of the device-count flags.

JAX's persistent compilation cache is on in the pytest processes (.pytest_cache/jax-cache, every program
cached); the commands the tests start keep out of it and out of the user's cache.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

# The compile flags of every test process: this one (set before JAX starts), the commands it runs (inherited),
# and the workers that set XLA_FLAGS themselves (sharding, multi-host: ``xla_flags``).
TEST_XLA_FLAGS = "" if os.environ.get("JAXGPT_TEST_XLA_OPT", "0") == "default" else (
    f"--xla_backend_optimization_level={os.environ.get('JAXGPT_TEST_XLA_OPT', '0')} "
    "--xla_llvm_disable_expensive_passes=true")
# An XLA that does not know the emitters flag aborts the process, so it is set only for the jaxlib it was
# verified with.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if (TEST_XLA_FLAGS and os.environ.get("JAXGPT_TEST_FUSION_EMITTERS") != "default"
        and importlib.metadata.version("jaxlib").startswith("0.10.")):
    TEST_XLA_FLAGS += f" {LEGACY_EMITTERS}"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once, however often this module is imported
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# One CPU device per core, as the jaxgpt command and fit give a user: the sharded and multi-device tests use them
from jaxgpt import use_host_devices  # noqa: E402 - after the setup above, which must run first

use_host_devices()

import pytest  # noqa: E402 - after the setup above, which must run first

# Persistent compilation cache, with the commands' settings (jaxgpt.cli.compile_cache): every program cached,
# however fast it compiled, and no size cap (with one, JAX locks and scans the folder on every write).
# Unlocked, two xdist workers may race on one entry; JAX then warns and compiles instead (a read error is never
# fatal). JAXGPT_TEST_JAX_CACHE=off turns it off. Only this process uses it: the subprocesses the tests start do
# not (JAX writes an entry in place, so a test that SIGKILLs a run could leave a truncated one behind).
from jaxgpt.cli import compile_cache  # noqa: E402 - after the setup above, which must run first

compile_cache.enable(os.environ.get("JAXGPT_TEST_JAX_CACHE",
                                    str(Path(__file__).resolve().parents[2] / ".pytest_cache" / "jax-cache")))
# ...and the commands the tests start keep out of the user's cache (jaxgpt.cli.compile_cache)
os.environ["JAXGPT_COMPILE_CACHE"] = "off"
# Kernel choices do not depend on a timing taken while other tests load the cores: every kernel runs
# where it can (jaxgpt/nn/kernels/calibrate.py; test_calibrate.py tests the measured choice itself)
os.environ.setdefault("JAXGPT_CALIBRATION", "off")


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a worker process that picks its own (a device count): the tests' compile flags too."""
    return " ".join((TEST_XLA_FLAGS, *flags)).strip()


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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``same_bits`` test compares two different programs bit for bit (a loop of steps against one-step calls),
    which holds as XLA compiles by default, not with the tests' compile flags: it runs in a fresh pytest
    process compiled as users compile (no test-only XLA flag), and passes or fails with it."""
    if not (pyfuncitem.get_closest_marker("same_bits") and TEST_XLA_FLAGS):
        return None
    env = dict(os.environ, JAXGPT_TEST_XLA_OPT="default",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip())
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid}, run with XLA's default fusion emitters, failed:\n{r.stdout[-6000:]}"
                    f"{r.stderr[-2000:]}", pytrace=False)
    return True
