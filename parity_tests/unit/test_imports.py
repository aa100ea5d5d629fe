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

from jaxgpt import testing as kit

ROOT = Path(__file__).resolve().parents[2]

TORCH_SIDE = ["torch_ref", "torch_ref.models", "torch_ref.nn.attnres", "torch_ref.convert", "torch_ref.train",
              "torch_ref.generate"]
JAX_SIDE = ["jaxgpt", "jaxgpt.convert", "jaxgpt.train", "jaxgpt.inference.generate", "jaxgpt.cli", "jaxgpt.data.prepare",
            "jaxgpt.data.token_task", "jaxgpt.train.tensorboard", "jaxgpt.nnx", "jaxgpt.testing"]


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
    from parity_tests.plugins import fixtures

    monkeypatch.delenv("CI", raising=False)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(fixtures, "SHARED", tmp_path / "no-shared")

    def outcome_of(f, *args):  # BaseException: a skip inside pytest.raises(Failed) would skip this test
        with pytest.raises(BaseException) as info:
            f(*args)
        assert info.type is outcome, f"expected {outcome.__name__}, got {info.type.__name__}: {info.value}"
        return str(info.value)

    msg = outcome_of(fixtures.seed_classes, "000_anything.txt", ["Anything"])
    assert str(tmp_path / "no-shared" / "seeds" / "000_anything.txt") in msg and "is missing" in msg
    msg = outcome_of(fixtures.require_shared, tmp_path / "no-shared" / "data" / "tinyshakespeare.txt", "corpus")
    assert ("CI=true, so a missing reference is an error" in msg) == (ci in ("true", "1"))
    assert fixtures.require_shared(tmp_path) == tmp_path  # present: returned, no skip


def test_error_tables_keep_self_consistency_apart(scratch_tables):
    """assert_close rows go to the parity table, assert_self_consistent rows to their own."""
    report = scratch_tables
    kit.assert_close([1.0, 2.0], [1.0, 2.0 + 4e-6], "probe parity")
    kit.assert_self_consistent([1.0], [1.0 + 2e-6], "probe self")
    assert set(report.WORST["parity"]) == {"probe parity"} and set(report.WORST["self"]) == {"probe self"}
    assert abs(report.WORST["parity"]["probe parity"] - 4e-6) < 1e-9
    with pytest.raises(ValueError, match="kind must be one of"):
        kit.record("probe", 0.0, kind="other")


def test_gradient_rule_divides_each_leaf_by_max_1_and_its_scale(scratch_tables):
    import numpy as np

    def tree(big, small):
        return {"big": {"scale": np.array(big)}, "small": {"bias": np.array(small)}}

    ref = tree([60.0, -3.0], [0.5, 0.1])
    ok = tree([60.0 + 5e-4, -3.0], [0.5 + 5e-6, 0.1])
    assert abs(kit.grads_err(ok, ref) - 5e-4 / 60) < 1e-9  # big leaf: 8.3e-6 after / 60
    assert kit.assert_grads_close(ok, ref, "probe grads") <= kit.TOL
    bad = tree([60.0, -3.0], [0.5 + 2e-5, 0.1])  # |g| < 1: the error is not scaled up
    with pytest.raises(AssertionError, match="probe grads: max abs error 2.0"):
        kit.assert_grads_close(bad, ref, "probe grads")


@pytest.mark.parametrize("ci,outcome", [(None, pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_missing_test_dependency_skips_locally_and_fails_under_ci(ci, outcome, monkeypatch):
    """require_module (transformers in test_hf_dir.py, ...): present, the module; missing, a skip
    locally and a failure under CI=true (CI installs every test dependency)."""
    from parity_tests.plugins import fixtures

    monkeypatch.delenv("CI", raising=False)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    assert fixtures.require_module("json") is json
    with pytest.raises(BaseException) as info:
        fixtures.require_module("jaxgpt_no_such_package", allow_module_level=True)
    assert info.type is outcome and "jaxgpt_no_such_package is not installed" in str(info.value)


def test_float64_reference_is_float64_throughout(scratch_tables):
    """float64_module + float64_torch: torch_ref's `.float()` upcasts do not round the reference to
    float32 (its LayerNorm computes in float64), the float32 module is untouched, `.float()` comes back."""
    import numpy as np
    import torch

    from torch_ref.nn.norms import LayerNorm

    norm = LayerNorm(8)
    x = np.random.default_rng(0).standard_normal((3, 8)) * 1e3 + 1e4  # large mean: float32 stats lose digits
    norm64 = kit.float64_module(norm)
    with kit.float64_torch():
        y64 = norm64(torch.from_numpy(x))
    assert y64.dtype == torch.float64 and norm.scale.dtype == torch.float32
    xc = x - x.mean(-1, keepdims=True)
    exact = xc / np.sqrt((xc ** 2).mean(-1, keepdims=True) + 1e-5)
    assert np.abs(y64.detach().numpy() - exact).max() < 1e-12
    assert torch.ones(2, dtype=torch.float64).float().dtype == torch.float32  # restored
    with kit.float64_torch():  # a float32 leak inside the reference is caught by the hooks
        with pytest.raises(AssertionError, match=r"float64 reference: LayerNorm returned \{'torch.float32'\}"):
            kit.float64_module(norm)(torch.from_numpy(x.astype(np.float32)))


def test_float64_rule_bounds_jaxgpt_by_k_times_torch(scratch_tables):
    """error(jaxgpt vs float64) <= max(TOL, K64 x error(torch vs float64)); the direct float32
    comparison only when asked; errors, ratio and margins recorded."""
    import numpy as np

    report = scratch_tables
    k, exact = kit.K64, np.linspace(-1, 1, 5)
    torch32 = exact + 2e-5  # torch's own float32 error: 2e-5, so the bound is K64 x 2e-5
    ok = exact - 0.9 * k * 2e-5
    assert kit.assert_as_accurate_as_torch(ok, torch32, exact, "probe f64", direct=False) > kit.TOL
    m = report.MARGINS["probe f64"]
    assert abs(m["ratio"] - 0.9 * k) < 1e-6 and abs(m["headroom"] - 1 / 0.9) < 1e-6 and m["direct_headroom"] == 0
    assert abs(m["direct"] - (0.9 * k + 1) * 2e-5) < 1e-9
    with pytest.raises(AssertionError, match=r"probe f64: max abs error"):  # the direct check, when asked
        kit.assert_as_accurate_as_torch(ok, torch32, exact, "probe f64")
    with pytest.raises(AssertionError, match=r"probe f64: jaxgpt float32 vs float64 reference .* > max\(1e-05, "):
        kit.assert_as_accurate_as_torch(exact + 1.1 * k * 2e-5, torch32, exact, "probe f64", direct=False)
    with pytest.raises(AssertionError, match="probe f64"):  # torch exact: the 1e-5 floor applies
        kit.assert_as_accurate_as_torch(exact + 2e-5, exact, exact, "probe f64", direct=False)
    grads = {"layer": {"kernel": exact[:, None] * 30}}  # the gradient rule: / max(1, max|g|) = / 30
    off = {"layer": {"kernel": grads["layer"]["kernel"] + 2e-4}}
    assert abs(kit.assert_as_accurate_as_torch(off, grads, grads, "probe g", grads=True, direct=False)
               - 2e-4 / 30) < 1e-9


def test_tables_merge_across_xdist_workers(scratch_tables):
    """A worker's tables (sent as JSON at the end of its session) fold into the controller's: worst errors,
    largest tolerances, worst margins."""
    report = scratch_tables
    kit.assert_close([1.0], [1.0 + 1e-6], "probe a")
    kit.assert_as_accurate_as_torch([1.0 + 1e-6], [1.0 + 2e-6], [1.0], "probe m")
    worker = json.loads(json.dumps(report._tables()))
    worker["worst"]["parity"]["probe a"] = 3e-6
    worker["worst"]["self"]["probe s"] = 1e-7
    worker["margins"]["probe m"].update(jaxgpt=5e-6, headroom=2.0)
    report._merge(worker)
    assert report.WORST["parity"]["probe a"] == 3e-6 and report.WORST["self"]["probe s"] == 1e-7
    m = report.MARGINS["probe m"]
    assert m["jaxgpt"] == 5e-6 and m["headroom"] == 2.0 and len(m["ratios"]) == 2
    assert "| probe m | 2 | 5.00e-06 | 2.00e-06 | 0.50 | - | 2.0 | 1.00e-06 | 10.0 |" in report.margins_markdown()


def test_no_script_runs_its_own_jax_training_loop():
    """Every JAX training in scripts/ goes through the library (``fit``, ``make_train_step``), with its
    batch checks, NaN stop and mesh: no script takes gradients or applies an optimizer itself (issue 41).
    The torch loops in scripts/ are the baselines raced against (nanoGPT, torch_ref eager). Text only."""
    import re

    own = re.compile(r"\bvalue_and_grad\b|\bjax\.grad\b|\bapply_updates\b|\bopt(?:imizer)?\.update\(")
    found = [f"{py.relative_to(ROOT)}:{i}: {line.strip()}" for py in sorted((ROOT / "scripts").rglob("*.py"))
             for i, line in enumerate(py.read_text().splitlines(), 1) if own.search(line)]
    assert not found, "scripts/ must train through jaxgpt.train, not a loop of their own:\n" + "\n".join(found)
