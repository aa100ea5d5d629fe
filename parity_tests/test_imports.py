"""Framework boundaries, checked in fresh interpreters: torch_ref never imports JAX or Flax, jaxgpt
never imports torch, and jaxgpt.core.layout (what the two share) imports neither. Also: the shared layout
facts have one source (the old homes re-export them), and the harness turns a missing ../shared
into an error under CI=true."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TORCH_SIDE = ["torch_ref", "torch_ref.models", "torch_ref.nn.attnres", "torch_ref.convert", "torch_ref.train",
              "torch_ref.generate"]
JAX_SIDE = ["jaxgpt", "jaxgpt.convert", "jaxgpt.train", "jaxgpt.inference.generate"]


def first_importers(modules: list[str], banned: set[str]) -> dict[str, list[str]]:
    """Import ``modules`` in order in one fresh interpreter; {module: banned packages that
    importing it added to sys.modules}. Sequential imports keep this to one interpreter start,
    and each offender is still named (the first module that pulls a package in)."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        out = {{}}
        for m in {modules!r}:
            before = {{k.split('.')[0] for k in sys.modules}}
            importlib.import_module(m)
            out[m] = sorted(({{k.split('.')[0] for k in sys.modules}} - before) & set({sorted(banned)!r}))
        out["<all>"] = sorted({{k.split('.')[0] for k in sys.modules}})
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"importing {modules} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_ref_imports_no_jax_or_flax():
    found = first_importers(TORCH_SIDE, {"jax", "jaxlib", "flax"})
    assert "torch" in found.pop("<all>")  # sanity: the probe sees what was imported
    assert not any(found.values()), f"torch_ref must not import JAX/Flax: {found}"


def test_jaxgpt_imports_no_torch():
    found = first_importers(JAX_SIDE, {"torch"})
    found.pop("<all>")
    assert not any(found.values()), f"jaxgpt must not import torch: {found}"


def test_layout_imports_no_framework():
    found = first_importers(["jaxgpt.core.layout"], {"jax", "jaxlib", "flax", "torch"})
    assert "numpy" in found.pop("<all>") and not found["jaxgpt.core.layout"], found


def test_layout_facts_have_one_source():
    """The old homes re-export jaxgpt.core.layout; encdec's STACKED agrees with it."""
    import jaxgpt.nn.attnres
    import jaxgpt.convert
    import jaxgpt.convert.rule
    import jaxgpt.core.layout as L
    import jaxgpt.models
    from jaxgpt.config import get_preset
    from jaxgpt.models.encdec import STACKED

    assert jaxgpt.convert.params_to_state_dict is jaxgpt.convert.rule.params_to_state_dict is L.params_to_state_dict
    assert jaxgpt.convert.state_dict_to_params is L.state_dict_to_params and jaxgpt.convert.to_numpy is L.to_numpy
    assert jaxgpt.models.stacked_paths is L.stacked_paths
    assert jaxgpt.nn.attnres.seal_schedule is L.seal_schedule and jaxgpt.nn.attnres.key_eps is L.key_eps
    assert L.stacked_paths(get_preset("seed-transformer")) == STACKED


@pytest.mark.parametrize("ci,outcome", [(None, pytest.skip.Exception), ("false", pytest.skip.Exception),
                                        ("true", pytest.fail.Exception), ("1", pytest.fail.Exception)])
def test_missing_shared_skips_locally_and_fails_under_ci(ci, outcome, monkeypatch, tmp_path):
    """With ../shared pointed at a missing folder, seed-based tests skip, unless CI is true: then they fail."""
    import conftest

    monkeypatch.delenv("CI", raising=False)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(conftest, "SHARED", tmp_path / "no-shared")

    def outcome_of(f, *args):  # BaseException: a skip inside pytest.raises(Failed) would skip this test
        with pytest.raises(BaseException) as info:
            f(*args)
        assert info.type is outcome, f"expected {outcome.__name__}, got {info.type.__name__}: {info.value}"
        return str(info.value)

    msg = outcome_of(conftest.seed_classes, "000_anything.txt", ["Anything"])
    assert str(tmp_path / "no-shared" / "seeds" / "000_anything.txt") in msg and "is missing" in msg
    msg = outcome_of(conftest.require_shared, tmp_path / "no-shared" / "data" / "tinyshakespeare.txt", "corpus")
    assert ("CI=true, so a missing reference is an error" in msg) == (ci in ("true", "1"))
    assert conftest.require_shared(tmp_path) == tmp_path  # present: returned, no skip


@pytest.fixture
def scratch_tables(monkeypatch):
    """Empty error tables for probing the harness (the run's own tables stay untouched)."""
    import conftest

    monkeypatch.setattr(conftest, "WORST", {kind: conftest.defaultdict(float) for kind in conftest.KINDS})
    monkeypatch.setattr(conftest, "TOLS", {kind: {} for kind in conftest.KINDS})
    return conftest


def test_error_tables_keep_self_consistency_apart(scratch_tables):
    """assert_close rows go to the parity table, assert_self_consistent rows to their own."""
    conftest = scratch_tables
    conftest.assert_close([1.0, 2.0], [1.0, 2.0 + 4e-6], "probe parity")
    conftest.assert_self_consistent([1.0], [1.0 + 2e-6], "probe self")
    assert set(conftest.WORST["parity"]) == {"probe parity"} and set(conftest.WORST["self"]) == {"probe self"}
    assert abs(conftest.WORST["parity"]["probe parity"] - 4e-6) < 1e-9
    with pytest.raises(ValueError, match="kind must be one of"):
        conftest.record("probe", 0.0, kind="other")


def test_gradient_rule_divides_each_leaf_by_max_1_and_its_scale(scratch_tables):
    conftest = scratch_tables

    import numpy as np

    def tree(big, small):
        return {"big": {"scale": np.array(big)}, "small": {"bias": np.array(small)}}

    ref = tree([60.0, -3.0], [0.5, 0.1])
    ok = tree([60.0 + 5e-4, -3.0], [0.5 + 5e-6, 0.1])
    assert abs(conftest.grads_err(ok, ref) - 5e-4 / 60) < 1e-9  # big leaf: 8.3e-6 after / 60
    assert conftest.assert_grads_close(ok, ref, "probe grads") <= conftest.TOL
    bad = tree([60.0, -3.0], [0.5 + 2e-5, 0.1])  # |g| < 1: the error is not scaled up
    with pytest.raises(AssertionError, match="probe grads: max abs error 2.0"):
        conftest.assert_grads_close(bad, ref, "probe grads")
