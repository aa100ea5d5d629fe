"""Smoke tests of scripts/experiments/exp_shakespeare.py (experiment 4: seed 003 / nanoGPT Shakespeare)
and its nanoGPT-faithful torch mirror scripts/experiments/nanogpt_torch.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, require_shared

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smoke  # the script end to end in a subprocess: make test-slow (seed003; the other parts, its
# heavier runs through the same code, are make test-experiments, out of CI for its time: issue 41)
@pytest.mark.parametrize("part", ["seed003", pytest.param("nanogpt", marks=pytest.mark.experiment),
                                  pytest.param("big", marks=pytest.mark.experiment)])
def test_smoke(tmp_path, part):
    require_shared(SHARED / "data" / "tinyshakespeare.txt", "data file")
    out = tmp_path / "shakespeare"
    subprocess.run([sys.executable, "-m", "scripts.experiments.exp_shakespeare", "--smoke", "--out", str(out),
                    "--parts", part], cwd=ROOT, check=True, timeout=600)
    res = json.loads((out / "shakespeare.json").read_text())
    assert res["smoke"] is True
    assert {"claims", "init_std", "dropout_semantics", "figures", "data"} <= set(res)
    assert (out / "README.md").exists()
    for fig in res["figures"]:
        assert (out / fig).stat().st_size < 200_000
    if part == "seed003":
        assert {r["framework"] for r in res["seed003"]} == {"jaxgpt", "torch"}
        for r in res["seed003"]:
            assert len(r["epochs"]) == 2 and math.isfinite(r["val_full"])
            assert r["sample"].startswith("To be or not")
    if part == "nanogpt":
        s = res["nanogpt_summary"]
        assert math.isfinite(s["jaxgpt_val_full"]["mean"]) and math.isfinite(s["torch_val_full"]["mean"])
        for r in res["nanogpt"]:
            assert {"val_own", "val_full", "val_estimates", "train_sample", "sample"} <= set(r)
    if part == "big":
        assert res["big"]["steps"] >= 1 and math.isfinite(res["big"]["val_sample_loss"])


def test_nanogpt_recipe_pieces():
    """get_lr and the weight-decay groups follow nanoGPT's train.py / configure_optimizers."""
    from scripts.experiments import nanogpt_torch as nt
    from torch_ref.models.decoder import DecoderLM

    nc = nt.NanoConfig()
    assert nt.get_lr(0, nc) == pytest.approx(1e-3 / 101)
    assert nt.get_lr(99, nc) == pytest.approx(1e-3 * 100 / 101)
    assert nt.get_lr(100, nc) == pytest.approx(1e-3)
    assert nt.get_lr(2000, nc) == pytest.approx(1e-4)
    assert nt.get_lr(2500, nc) == pytest.approx(1e-4)
    model = DecoderLM(nt.model_config(nc))
    decay, no_decay = nt.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "tok_embed.weight" in decayed and "pos_embed.weight" in decayed  # embeddings decayed, as nanoGPT
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert not any(n for n, p in model.named_parameters() if n.endswith("bias"))  # bias=False
