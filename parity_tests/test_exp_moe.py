"""Smoke test of the MoE experiment (scripts/experiments/exp_moe.py): runs with --smoke in a
subprocess and writes its results JSON, README, claims and figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, require_shared

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.smoke  # runs a script end to end in a subprocess: make test-slow


def test_exp_moe_smoke(tmp_path):
    require_shared(SHARED / "data" / "tinyshakespeare.txt", "Tiny Shakespeare")
    subprocess.run([sys.executable, "-m", "scripts.experiments.exp_moe", "--smoke", "--out", str(tmp_path)], check=True,
                   cwd=ROOT, timeout=600)
    data = json.loads((tmp_path / "moe.json").read_text())
    assert data["smoke"] is True and data["experiment"] == "moe"
    assert set(data["models"]) == {"dense", "moe"}
    assert data["params"]["moe"]["active"] - data["params"]["dense"]["active"] == 4 * 64 * 8  # the routers only
    load = data["models"]["moe"]["runs"][0]["load"][-1]  # (layers, experts) shares of the top-2 picks
    assert len(load) == 4 and all(abs(sum(row) - 1) < 1e-5 for row in load)
    assert len(data["claim_rows"]) == 3
    assert (tmp_path / "router_load.png").stat().st_size and (tmp_path / "val_loss.png").stat().st_size
