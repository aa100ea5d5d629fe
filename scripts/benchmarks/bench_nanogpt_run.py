"""Issue #19's real run: nanoGPT's own ``train.py`` on its README CPU config against ``jaxgpt train``
with the same settings, start to finish (wall time of each process), and the final validation loss.

    .venv/bin/python -m scripts.benchmarks.bench_nanogpt_run --nanogpt PATH/TO/nanoGPT [--rounds 2]

PATH/TO/nanoGPT is a checkout of github.com/karpathy/nanoGPT (not shipped here) with
``data/shakespeare_char/{train,val}.bin`` and ``meta.pkl`` prepared (its prepare.py; give it
../shared/data/tinyshakespeare.txt as input.txt where there is no network). jaxgpt trains on the
same token files. The rounds alternate nanoGPT, jaxgpt, nanoGPT, jaxgpt; each is its own process.
jaxgpt's persistent compilation cache (jaxgpt/cli/compile_cache.py) starts empty in a folder of the
benchmark's own: its first round compiles (cold), later rounds load the programs (warm), as a user's
first and later runs do; both are reported.

nanoGPT's README command (CPU, no torch.compile):
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
jaxgpt, the same run: the gpt2-shakespeare-char preset (learned positions, LayerNorm, exact GELU,
no biases, tied embeddings) cut to 4 x 128, block 64, batch 12, 2000 steps, lr 1e-3 with 100
warmup steps and cosine to 1e-4, beta2 0.99, weight decay 0.1 on matrices (nanoGPT's grouping),
clip 1.0, dropout 0, 20 validation batches every 250 steps, a checkpoint every 250.
nanoGPT runs iterations 0..2000 (2001 updates) and evaluates 20 train + 20 val batches; the
reported loss is each run's last validation estimate.

Results: results/engine/nanogpt_run.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.harness import RESULTS, ROOT, LoadSampler, timing_note, write_result

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
JAXGPT_SETS = ["n_layer=4", "n_head=4", "d_model=128", "max_len=64", "dropout=0.0", "steps=2000", "batch_size=12",
               "seq_len=64", "lr=1e-3", "warmup_steps=100", "min_lr_ratio=0.1", "beta2=0.99", "decay=matrices",
               "grad_clip=1.0", "eval_every=250", "eval_batches=20", "ckpt_every=250",
               # nanoGPT's train.py defaults to bias=False; the preset is GPT-2's, with biases
               "norm_bias=false", "qkv_bias=false", "o_bias=false", "mlp_bias=false"]


def run_nanogpt(repo: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "train.py", *NANOGPT_ARGS, f"--out_dir={out}"], cwd=repo,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"nanoGPT's train.py failed:\n{r.stderr[-3000:]}")
    vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", r.stdout)
    return dict(wall_s=wall, val_loss=float(vals[-1][2]), last_eval_step=int(vals[-1][0]))


def run_jaxgpt(data: Path, out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "jaxgpt", "train", "--preset", "gpt2-shakespeare-char", "--data", str(data),
           "--out", str(out), "--quiet"] + [a for s in JAXGPT_SETS for a in ("--set", s)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "JAXGPT_COMPILE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"jaxgpt train failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [row for row in rows if "val_loss" in row]
    return dict(wall_s=wall, val_loss=val[-1]["val_loss"], last_eval_step=val[-1].get("step"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", required=True, type=Path, help="a karpathy/nanoGPT checkout, data prepared")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "engine" / "nanogpt_run.json"))
    a = ap.parse_args(argv)
    data = a.nanogpt / "data" / "shakespeare_char"
    if not (data / "train.bin").is_file():
        raise SystemExit(f"{data}/train.bin is missing: run nanoGPT's data/shakespeare_char/prepare.py first")
    load = LoadSampler()
    load.start()
    before = os.popen("uptime").read().strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "xla"  # jaxgpt's compilation cache, empty at the start: round 0 compiles, later rounds load
        for i in range(a.rounds):
            for name in ("nanoGPT train.py", "jaxgpt train"):
                out = Path(tmp) / f"{name.split()[0]}-{i}"
                r = run_nanogpt(a.nanogpt, out) if name.startswith("nano") else \
                    dict(run_jaxgpt(data, out, cache), compile_cache="cold" if i == 0 else "warm")
                rows.append(r := dict(runner=name, round=i, **r))
                print(r, file=sys.stderr, flush=True)
    after = os.popen("uptime").read().strip()
    med = {n: float(np.median([r["wall_s"] for r in rows if r["runner"] == n])) for n in {r["runner"] for r in rows}}
    ratio = med["nanoGPT train.py"] / med["jaxgpt train"]
    cold = [r["wall_s"] for r in rows if r.get("compile_cache") == "cold"]
    warm = [r["wall_s"] for r in rows if r.get("compile_cache") == "warm"]
    lines = ["| runner | round | compile cache | wall s | val loss |", "|---|---|---|---|---|"]
    lines += [f"| {r['runner']} | {r['round']} | {r.get('compile_cache', '')} | {r['wall_s']:.1f} | {r['val_loss']:.4f} |"
              for r in rows]
    note = (f"Median wall: nanoGPT {med['nanoGPT train.py']:.1f} s, jaxgpt {med['jaxgpt train']:.1f} s (every round): "
            f"jaxgpt runs at {ratio:.2f}x nanoGPT's speed; its first run, compiling, {np.median(cold):.1f} s"
            + (f", later runs, loading the compiled programs, {np.median(warm):.1f} s" if warm else "")
            + f". {timing_note(load.record())}. uptime before: `{before}`; after: `{after}`.")
    write_result(a.out, dict(rows=rows, median_wall_s=med, speed_ratio=ratio, load=load.record(), note=note,
                             nanogpt_args=NANOGPT_ARGS, jaxgpt_sets=JAXGPT_SETS), "\n".join(lines) + f"\n\n{note}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
