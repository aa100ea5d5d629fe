"""The scripts behind results/defaults (issue 50): the full-split scorer of
scripts/benchmarks/nanogpt_losses.py against nanoGPT's own torch model, and a smoke run of
scripts/experiments/finetune_defaults.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED, assert_close, require_shared

ROOT = Path(__file__).resolve().parents[2]


def test_tiled_windows_cover_the_split_once():
    from scripts.benchmarks.nanogpt_losses import tiled

    ids = np.arange(23)
    w = tiled(ids, 5)  # (23 - 1) // 5 = 4 windows of 6 tokens, each predicting the 5 after its first
    assert w.tolist() == [list(range(i * 5, i * 5 + 6)) for i in range(4)]
    assert np.array_equal(w[:, 1:].ravel(), ids[1:21])  # every predicted token once, in order


def test_full_split_score_of_a_nanogpt_model_is_its_torch_loss(tmp_path):
    """score_nanogpt's JAX score (jaxgpt.convert.nanogpt, jaxgpt's eval step) against nanoGPT's own
    model.py forward on the same windows: float32, 1e-5."""
    import torch

    from scripts.benchmarks.nanogpt_losses import nanogpt_model, score_nanogpt, tiled

    repo = require_shared(SHARED / "reference" / "nanogpt", "nanoGPT's model.py")
    nano = nanogpt_model(repo)
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=False, vocab_size=65, dropout=0.0)
    torch.save(dict(model=nano.GPT(nano.GPTConfig(**args)).state_dict(), model_args=args), tmp_path / "final.pt")
    windows = tiled(np.random.default_rng(0).integers(0, 65, 16 * 150 + 1), 16)  # 150 windows: two chunks
    scores = score_nanogpt(repo, tmp_path, windows)
    assert 3.0 < scores["val_full_torch"] < 6.0  # near ln(65) for random weights
    assert_close(scores["val_full"], scores["val_full_torch"], "nanoGPT model: JAX full-split score vs torch")


@pytest.mark.experiment  # five short trainings: make test-experiments, out of CI for its time
def test_finetune_defaults_smoke(tmp_path):
    require_shared(SHARED / "data" / "tinyshakespeare.txt", "data file")
    out = tmp_path / "finetune.json"
    subprocess.run([sys.executable, "-m", "scripts.experiments.finetune_defaults", "--smoke", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=900)
    res = json.loads(out.read_text())
    assert {(r["warmup"], r["decay"]) for r in res["rows"]} == {(0, "all"), (0, "matrices"), (3, "all"),
                                                               (3, "matrices")}
    assert all(r["val_full"] < res["pretrained_val_full"] for r in res["rows"])  # fine-tuning helps
    assert out.with_suffix(".md").read_text().startswith("| warmup | decay | seed |")
