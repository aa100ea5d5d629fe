"""Training defaults by entry point (issue 50; evidence in results/defaults/): the GPT-2 presets decay
matrices only, ``--init`` fine-tuning decays matrices only and warms up, and seed 000's recipe (the
seed presets, ``make demo``) keeps TrainConfig's own defaults. The pins are stated values, not
recomputed by the code under test."""
from __future__ import annotations

import pytest

from jaxgpt.cli import main
from jaxgpt.config import INIT_DEFAULTS, PRESETS, TrainConfig, apply_sets, get_preset, init_warmup, train_defaults
from jaxgpt.train.checkpoint import Checkpoints

SEED_000 = dict(lr=3e-4, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                weight_decay=0.1, decay="all", grad_clip=1.0, batch_size=32, seq_len=64, steps=500)


def test_seed_recipe_is_trainconfigs_default_and_the_seed_presets_keep_it():
    assert {k: getattr(TrainConfig(), k) for k in SEED_000} == SEED_000
    for name in ("seed-minigpt", "seed-minigpt-nopos", "seed-attnres-block", "seed-transformer", "llama-tiny"):
        assert train_defaults(name) == {}
        assert apply_sets(get_preset(name), [], train_defaults(name))[1] == TrainConfig()


def test_gpt2_presets_decay_matrices_unless_set():
    gpt2 = sorted(n for n in PRESETS if n.startswith("gpt2"))
    assert gpt2 == ["gpt2-large", "gpt2-medium", "gpt2-shakespeare-char", "gpt2-small", "gpt2-xl"]
    for name in gpt2:
        _, tc = apply_sets(get_preset(name), ["steps=7"], train_defaults(name))
        assert (tc.decay, tc.steps) == ("matrices", 7)
        assert tc.replace(decay="all") == TrainConfig(steps=7)  # nothing else differs from seed 000's
    assert apply_sets(get_preset("gpt2-small"), ["decay=all"], train_defaults("gpt2-small"))[1].decay == "all"
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        train_defaults("gpt5")


@pytest.mark.parametrize("tc, warmup", [
    (TrainConfig(steps=3), 0),  # too short to warm up
    (TrainConfig(steps=40), 2),  # 5%
    (TrainConfig(steps=1000), 50),
    (TrainConfig(steps=100_000), 100),  # at most 100
    (TrainConfig(steps=1000, schedule="constant"), 0),  # a constant lr has no warmup
    (TrainConfig(epochs=40, steps_per_epoch=10, steps=400, lr_per_epoch=True), 2),  # counted in epochs
])
def test_init_warmup_is_five_percent_at_most_100(tc, warmup):
    assert INIT_DEFAULTS == {"decay": "matrices"}
    assert init_warmup(tc) == warmup


def _train(argv: list[str], capsys) -> tuple[dict, str]:
    """(the TrainConfig the run saved, its stdout)."""
    assert main(["train", *argv, "--quiet"]) == 0
    ckpts = Checkpoints(argv[argv.index("--out") + 1], create=False)
    train = ckpts.meta()["train"]
    ckpts.close()
    return train, capsys.readouterr().out


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_cli_defaults_per_entry_point_and_resume(tmp_path, capsys):
    """jaxgpt train: --preset gpt2-* saves decay='matrices'; a run saved under another decay (the old
    default) still resumes without --set; --init saves matrices and 5% warmup unless set, and resumes."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 40)
    small = ["--data", str(text), *[a for s in ("n_layer=1", "d_model=32", "n_head=2", "max_len=16", "seq_len=16",
                                                "batch_size=4", "eval_batches=1", "dropout=0.0") for a in ("--set", s)]]
    gpt2 = ["--preset", "gpt2-shakespeare-char", *small]
    tc, _ = _train([*gpt2, "--set", "steps=2", "--out", str(tmp_path / "new")], capsys)
    assert (tc["decay"], tc["warmup_steps"]) == ("matrices", 0)
    _train([*gpt2, "--set", "steps=2", "--set", "decay=all", "--out", str(tmp_path / "old")], capsys)
    tc, out = _train([*gpt2, "--set", "steps=2", "--out", str(tmp_path / "old")], capsys)  # no --set decay
    assert "resuming at step 2" in out and tc["decay"] == "all"

    init = ["--init", str(tmp_path / "new"), "--data", str(text), *[a for s in ("seq_len=16", "batch_size=4", "steps=40",
            "eval_batches=1", "eval_every=0", "ckpt_every=0") for a in ("--set", s)]]
    tc, _ = _train([*init, "--out", str(tmp_path / "ft")], capsys)
    assert (tc["decay"], tc["warmup_steps"], tc["lr"]) == ("matrices", 2, 3e-4)
    tc, out = _train([*init, "--out", str(tmp_path / "ft")], capsys)
    assert "resuming at step 40" in out and (tc["decay"], tc["warmup_steps"]) == ("matrices", 2)
    tc, _ = _train([*init, "--set", "decay=all", "--set", "warmup_steps=0", "--out", str(tmp_path / "ft0")], capsys)
    assert (tc["decay"], tc["warmup_steps"]) == ("all", 0)
