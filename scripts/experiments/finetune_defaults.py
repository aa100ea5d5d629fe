"""Fine-tuning defaults (issue 50): does ``jaxgpt train --init HF_DIR`` fine-tune better with an lr
warmup, and with weight decay on matrices only (``decay='matrices'``) rather than on every parameter?

    .venv/bin/python -m scripts.experiments.finetune_defaults [--seeds 0,1,2] [--steps 300] [--smoke]

1. A byte-level BPE tokenizer (``tokenizers``, 512 tokens) is trained on the first 60% of Tiny
   Shakespeare, which ``jaxgpt prepare`` turns into token files.
2. Pre-training: ``jaxgpt train --preset llama-tiny`` cut to 4 x 128 (4 heads, 2 KV heads, SwiGLU
   352, RMSNorm, RoPE), seq 128, batch 16, lr 1e-3, 50 warmup steps, decay 'matrices'.
3. ``jaxgpt convert RUN HF --to hf``, with the tokenizer's tokenizer.json: a LLaMA HF directory.
4. Fine-tuning: ``jaxgpt train --init HF --data FT`` on the other 40% of the text (its first 90% trained
   on, its last 10% held out, jaxgpt's split), at ``--lr`` (default TrainConfig's 3e-4, cosine to a tenth),
   batch 16 x 128, ``--steps`` updates; warmup 0 or ``--warmup`` steps x each of ``--decays`` ('all',
   'matrices'), for each seed (the seed draws the batches: every setting of one seed sees the same batches).

Scores of each fine-tuned model: *own* (jaxgpt's evaluation, 8 fixed batches of 16 windows chosen by
the seed) after 25 updates and at the end, and *full* (every non-overlapping 128-token window of
the held-out 10%, the same for every run) at the end. Every setting is passed explicitly, so the
results do not depend on the defaults they inform. Results: results/defaults/finetune.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxgpt.config import TrainConfig
from scripts.benchmarks.nanogpt_losses import jax_loss, stats, tiled
from scripts.harness import RESULTS, SHARED, write_result

MODEL = ["d_model=128", "n_layer=4", "n_head=4", "n_kv_head=2", "d_ff=352", "max_len=128"]
BATCH = ["batch_size=16", "seq_len=128"]
PRETRAIN = ["lr=1e-3", "warmup_steps=50", "decay=matrices", "eval_every=0", "eval_batches=4", "ckpt_every=0"]
FINETUNE = ["eval_every=25", "eval_batches=8", "ckpt_every=0", "log_every=5"]
PRETRAIN_FRACTION = 0.6


def cli(*argv: str) -> None:
    from jaxgpt.cli import main

    if main(list(argv)):
        raise RuntimeError(f"jaxgpt {' '.join(argv)} failed")


def sets(items) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def build_hf_dir(tmp: Path, text: str, pretrain_steps: int) -> Path:
    """Tokenizer, token files, pre-training run and its HF export; returns the HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cut = int(len(text) * PRETRAIN_FRACTION)
    (tmp / "pretrain.txt").write_text(text[:cut])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text[:cut].splitlines(keepends=True), trainer=trainer)
    tok.save(str(tmp / "tokenizer.json"))
    cli("prepare", str(tmp / "pretrain.txt"), str(tmp / "tokens"), "--tokenizer", str(tmp / "tokenizer.json"),
        "--val-fraction", "0.05", "--quiet")
    cli("train", "--preset", "llama-tiny", "--data", str(tmp / "tokens"), "--out", str(tmp / "pretrain"), "--quiet",
        *sets([*MODEL, *BATCH, *PRETRAIN, f"steps={pretrain_steps}"]))
    hf = tmp / "hf"
    cli("convert", str(tmp / "pretrain"), str(hf), "--to", "hf")
    (hf / "tokenizer.json").write_text((tmp / "tokenizer.json").read_text())
    return hf


def finetune(hf: Path, data: Path, out: Path, steps: int, seed: int, warmup: int, decay: str, lr: float) -> dict:
    cli("train", "--init", str(hf), "--data", str(data), "--out", str(out), "--quiet",
        *sets([*BATCH, *FINETUNE, f"steps={steps}", f"seed={seed}", f"warmup_steps={warmup}", f"decay={decay}",
               f"lr={lr}"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    train = [r["loss"] for r in rows if "loss" in r]
    return dict(val_own_25=val[min(val)], val_own=val[max(val)], train_first_25=float(np.mean(train[:25])),
                train_last_25=float(np.mean(train[-25:])))


def full_split(hf: Path, out: Path, text: str) -> tuple[float, float, int]:
    """(pre-trained model, fine-tuned model) on every 128-token window of the fine-tuning text's held-out 10%."""
    from jaxgpt.cli.common import load_hf_dir
    from jaxgpt.data import split_train_val
    from jaxgpt.data.hf_tokenizer import HFTokenizer
    from jaxgpt.train.checkpoint import Checkpoints

    _, val = split_train_val(np.asarray(HFTokenizer.from_dir(hf).encode(text)), 0.1)  # jaxgpt's split of FT
    windows = tiled(val, 128)
    config, params, _ = load_hf_dir(str(hf))
    before = jax_loss(config, params, windows)
    ckpts = Checkpoints(out, create=False)
    config, params, _ = ckpts.restore_params()
    ckpts.close()
    return before, jax_loss(config, params, windows), int(windows[:, 1:].size)


def report(rows: list[dict], before: float, tokens: int, a) -> tuple[dict, str]:
    keys = ("val_own_25", "val_own", "val_full", "train_first_25")
    settings = sorted({(r["warmup"], r["decay"]) for r in rows})
    summary = {f"warmup={w} decay={d}": {k: stats([r[k] for r in rows if (r["warmup"], r["decay"]) == (w, d)])
                                         for k in keys} for w, d in settings}
    first = settings[0]  # warmup 0 and the first decay: with 'all', the old --init defaults
    base = {r["seed"]: r for r in rows if (r["warmup"], r["decay"]) == first}
    for name, s in summary.items():
        own = [r for r in rows if f"warmup={r['warmup']} decay={r['decay']}" == name]
        s["val_full_vs_first"] = stats([r["val_full"] - base[r["seed"]]["val_full"] for r in own])
    fmt = lambda ms: f"{ms[0]:.4f} ± {ms[1]:.4f}"
    lines = ["| warmup | decay | seed | val own @25 | val own (end) | val full (end) | train, first 25 |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['warmup']} | {r['decay']} | {r['seed']} | {r['val_own_25']:.4f} | {r['val_own']:.4f} | "
              f"{r['val_full']:.4f} | {r['train_first_25']:.4f} |" for r in rows]
    lines += ["", f"| setting | val own @25 | val own (end) | val full (end) | full - (warmup 0, {first[1]}), paired |",
              "|---|---|---|---|---|"]
    lines += [f"| {n} | {fmt(s['val_own_25'])} | {fmt(s['val_own'])} | {fmt(s['val_full'])} | "
              f"{fmt(s['val_full_vs_first'])} |" for n, s in summary.items()]
    lines += ["", f"Mean ± sd over seeds {a.seeds}. {a.steps} fine-tuning updates of 16 x 128 tokens at lr {a.lr:g} "
              f"(cosine to {a.lr / 10:g}), weight decay 0.1, from a 4 x 128 LLaMA pre-trained for {a.pretrain_steps} updates on "
              "the first 60% of Tiny Shakespeare (512-token BPE) and exported as an HF directory. *own*: jaxgpt's "
              "evaluation (8 fixed batches of 16 windows chosen by the seed); *full*: every non-overlapping "
              f"128-token window of the held-out 10% of the fine-tuning text ({tokens:,} predicted tokens, the same "
              f"for every run). The pre-trained model scores {before:.4f} on it before fine-tuning. *train, first 25*: "
              "the mean training loss of the first 25 updates (the same batches in every setting of a seed)."]
    return summary, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300, help="fine-tuning updates per run")
    ap.add_argument("--warmup", type=int, default=15, help="the warmup tried against none (default: 5%% of 300)")
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=TrainConfig().lr, help="fine-tuning peak lr (default: --init's)")
    ap.add_argument("--decays", default="all,matrices")
    ap.add_argument("--smoke", action="store_true", help="a few steps of everything (a check that it runs)")
    ap.add_argument("--out", default=str(RESULTS / "defaults" / "finetune.json"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.pretrain_steps, a.seeds = 30, 3, 60, "0"
    started = time.time()
    text = (SHARED / "data" / "tinyshakespeare.txt").read_text()
    ft_text = text[int(len(text) * PRETRAIN_FRACTION):]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = build_hf_dir(tmp, text, a.pretrain_steps)
        (tmp / "finetune.txt").write_text(ft_text)
        for seed in [int(s) for s in a.seeds.split(",")]:
            for warmup in (0, a.warmup):
                for decay in a.decays.split(","):
                    out = tmp / f"ft-{seed}-{warmup}-{decay}"
                    r = finetune(hf, tmp / "finetune.txt", out, a.steps, seed, warmup, decay, a.lr)
                    before, r["val_full"], tokens = full_split(hf, out, ft_text)
                    rows.append(dict(seed=seed, warmup=warmup, decay=decay, **r))
                    print(rows[-1], file=sys.stderr, flush=True)
    summary, table = report(rows, before, tokens, a)
    write_result(a.out, dict(rows=rows, summary=summary, pretrained_val_full=before, val_full_tokens=tokens,
                             steps=a.steps, warmup=a.warmup, pretrain_steps=a.pretrain_steps, lr=a.lr,
                             model=MODEL, batch=BATCH, pretrain=PRETRAIN, finetune=FINETUNE,
                             wall_s=round(time.time() - started, 1)), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
