"""The MoE experiment (scripts/experiments/exp_moe.py): its balance criterion against hand-computed
values and its --aux-per-layer option (fast), and a --smoke run of a 2-coefficient sweep with the
per-layer loss in a subprocess that writes its results JSON, README, claims and figures (smoke tier)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED, require_shared
from scripts.experiments import exp_moe

ROOT = Path(__file__).resolve().parents[2]


def test_aux_per_layer_sets_the_library_scope():
    """--aux-per-layer trains with moe.aux_loss_scope='layer' (the hand-made case of pooled vs per layer
    is test_moe.py's); the default run keeps transformers' pooled loss."""
    assert exp_moe.model_config("moe", 65, 64, aux_scope="layer").moe.aux_loss_scope == "layer"
    assert exp_moe.model_config("moe", 65, 64).moe.aux_loss_scope == "pooled"


def test_balance_criterion():
    """load_summary on hand-made final loads of 8 experts (share x 8 in the comments)."""
    fair = [[1 / 8] * 8] * 4  # (L, E): every layer uniform
    skew = [[0.18] + [0.82 / 7] * 7] + fair[1:]  # layer 0's busiest x1.44, the rest x0.94
    starved = [[0.06] + [0.94 / 7] * 7] + fair[1:]  # layer 0's least-used x0.48 (< 0.5)
    busy = [[0.19] + [0.81 / 7] * 7] + fair[1:]  # busiest x1.52 (> 1.5)
    run = lambda final: {"load": [fair, final]}  # only the final evaluation counts
    ok = exp_moe.load_summary([run(fair), run(skew)], 1.5, 0.5)
    assert ok["balanced"] and ok["busiest"]["max"] == pytest.approx(1.44) and ok["least"]["min"] == pytest.approx(0.82 / 7 * 8)
    assert ok["busiest_per_layer"][1][0] == pytest.approx(1.44) and ok["busiest_per_layer"][0] == pytest.approx([1] * 4)
    assert not exp_moe.load_summary([run(fair), run(starved)], 1.5, 0.5)["balanced"]
    assert not exp_moe.load_summary([run(busy), run(fair)], 1.5, 0.5)["balanced"]


def test_parse_coefs():
    assert exp_moe.parse_coefs("1,0.01, 0.1") == [0.01, 0.1, 1.0]
    for bad in ("0.1,x", "-1", "0.1,0.1", ""):
        with pytest.raises(SystemExit, match="--aux-coefs"):
            exp_moe.parse_coefs(bad)


@pytest.mark.smoke  # runs the script end to end in a subprocess: make test-slow
def test_exp_moe_smoke(tmp_path):
    require_shared(SHARED / "data" / "tinyshakespeare.txt", "Tiny Shakespeare")
    subprocess.run([sys.executable, "-m", "scripts.experiments.exp_moe", "--smoke", "--aux-coefs", "0.01,1",
                    "--aux-per-layer", "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=600)
    data = json.loads((tmp_path / "moe.json").read_text())
    assert data["smoke"] is True and data["experiment"] == "moe"
    assert data["config"]["aux_coefs"] == [0.01, 1.0] and set(data["sweep"]) == {"0.01", "1"}
    assert data["config"]["aux_per_layer"] is True
    assert data["params"]["moe"]["active"] - data["params"]["dense"]["active"] == 4 * 64 * 8  # the routers only
    for key, arm in data["sweep"].items():
        assert arm["aux_coef"] == float(key) and len(arm["runs"]) == 1
        load = np.asarray(arm["runs"][0]["load"][-1])  # (layers, experts) shares of the top-2 picks
        assert load.shape == (4, 8) and np.allclose(load.sum(-1), 1, atol=1e-5)
        # self-consistency: the summary is this final load's busiest / least-used share x E
        assert arm["busiest"]["max"] == pytest.approx(load.max() * 8) and arm["least"]["min"] == pytest.approx(load.min() * 8)
    balanced = [arm["aux_coef"] for arm in data["sweep"].values() if arm["balanced"]]
    assert data["balancing_coef"] == (min(balanced) if balanced else None)
    sources = [r["source"] for r in data["claim_rows"]]
    assert sources.count("issue 39") == 2 and 2 <= sources.count("issue 21") <= 3  # loss row(s) + timing row
    readme = (tmp_path / "README.md").read_text()
    assert "--aux-coefs 0.01,1" in readme and "| 0.01 |" in readme and "| 1 |" in readme
    assert "--aux-per-layer" in readme and "aux_loss_scope='layer'" in readme
    for png in ("router_load.png", "router_load_layers.png", "val_loss.png"):
        assert (tmp_path / png).stat().st_size
