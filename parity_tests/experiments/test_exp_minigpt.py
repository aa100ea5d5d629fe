"""Smoke test of scripts/experiments/exp_minigpt.py (experiment 2 + its torch_ref half): the tiny version runs
end to end and writes its JSON, README and figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.smoke, pytest.mark.experiment]  # the script end to end in a subprocess: make test-experiments


def test_exp_minigpt_smoke(tmp_path):
    out = tmp_path / "minigpt"
    subprocess.run([sys.executable, "-m", "scripts.experiments.exp_minigpt", "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    res = json.loads((out / "minigpt.json").read_text())
    for key in ("runs", "curves", "epochs", "cross_framework", "kv_cache", "samples", "heatmaps", "claims"):
        assert key in res, key
    assert res["smoke"] is True
    assert len(res["runs"]) == 6  # baseline, 3 ablations, 2 embed_scale configs
    assert res["kv_cache"]["all_identical"]  # cached and uncached greedy decoding agree token for token
    assert res["heatmaps"]["max_weight_above_diagonal"] < 1e-6
    assert len(res["cross_framework"]["losses_torch"]) == res["steps"]
    # same init, same batches: the first steps agree to float32 precision
    assert res["cross_framework"]["max_abs_diff_first_20_steps"] < 1e-4
    assert {r["verdict"].split(" ")[0] for r in res["claims"]} <= {"holds", "does", "not"}
    for png in ("ablations.png", "embed_scale.png", "epochs.png", "cross_framework.png", "kv_cache.png",
                "attention.png"):
        assert (out / png).stat().st_size > 0, png
    assert (out / "README.md").read_text().startswith("# Experiment 2")
