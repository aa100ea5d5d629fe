"""Smoke tests of the experiment 3 scripts (seed 002 Attention Residuals): each runs with --smoke
in a subprocess and writes its results JSON, README and figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, require_shared

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.smoke, pytest.mark.experiment]  # scripts end to end in subprocesses: make test-experiments


def _run(module: str, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", f"scripts.experiments.{module}", "--smoke", "--out", str(out)], check=True,
                   cwd=ROOT, timeout=600)
    name = module.removeprefix("exp_")
    data = json.loads((out / f"{name}.json").read_text())
    assert data["smoke"] is True and data["experiment"] == name
    assert (out / "README.md").read_text().startswith("# Experiment 3")
    return data


def test_exp_attnres_smoke(tmp_path):
    require_shared(SHARED / "seeds" / "002_cf3e92bca7241f9e.txt", "seed file")  # --init seed draws from it
    data = _run("exp_attnres", tmp_path)
    assert {"config", "preset_check", "claims", "models", "torch_ref", "tolerance"} <= set(data)
    assert set(data["models"]) == {"standard", "full-seed"}
    for m in data["models"].values():
        assert {"accuracy", "loss_table", "epochs_to", "demo", "time_ratio", "final10_loss"} <= set(m)
        assert len(m["runs"][0]["outputs"]) == 50 and len(m["demo"]) == 10
    assert len(data["models"]["full-seed"]["depth_weights_mean"]) == 12  # 2 pseudo-queries x 6 layers
    assert all(all(c.values()) for c in data["preset_check"].values()), data["preset_check"]
    # same initial weights and batches: the first updates agree with torch_ref
    for t in data["torch_ref"].values():
        assert t["early_max_abs_diff"] < 1e-3
    for png in ("loss_seed.png", "depth_weights.png", "torch_vs_jax.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_exp_attnres_charlm_smoke(tmp_path):
    require_shared(SHARED / "data" / "tinyshakespeare.txt", "data file")
    data = _run("exp_attnres_charlm", tmp_path)
    assert set(data["models"]) == {"standard", "full-paper"}
    for m in data["models"].values():
        assert m["final_val"]["n"] == 1 and m["runs"][0]["val_loss"]
    for name, d in data["dilution"].items():
        assert len(d["init"]["input"]) == 2 * 4 and len(d["trained"]["output"]) == 2 * 4, name
    assert (tmp_path / "dilution.png").stat().st_size > 0
