"""The suite's skip rules and shared fixtures.

References that live outside the repository (../shared: seed texts, Tiny Shakespeare) are reached through
``require_shared``: a missing one skips the test locally, and fails it when the environment variable CI is
true (so CI cannot pass by skipping every seed comparison). Optional packages the tests need (transformers,
tokenizers, ...) go through ``require_module``, the same rule. The only skip CI accepts is a missing
accelerator (``ACCELERATOR_SKIP``); tests marked ``cpu_only`` hold only on the CPU backend (its C++ kernels,
no cuDNN) and are skipped elsewhere.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from scripts.harness import SHARED  # the one rule for ../shared: $JAXGPT_SHARED, beside the clone

torch.set_default_dtype(torch.float32)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# The one skip CI accepts: a test that needs an accelerator it does not have, or the CPU backend it
# is not on. Every such skip reason starts with this; under CI=true any other skip (no C++ compiler
# for the CPU kernels, one host device, ...) is reported as a failure, since it would hide one.
ACCELERATOR_SKIP = "accelerator:"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and on_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(ACCELERATOR_SKIP):
            report.outcome = "failed"
            report.longrepr = (f"CI=true: a skip hides a failure here; only '{ACCELERATOR_SKIP} ...' skips are "
                               f"accepted (parity_tests/plugins/fixtures.py). The skip: {reason}")


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


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "cpu":
        return
    skip = pytest.mark.skip(reason=f"{ACCELERATOR_SKIP} cpu_only: holds on the CPU backend only "
                                   f"(this run: {jax.default_backend()})")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)
