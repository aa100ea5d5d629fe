"""Issue #19's real run: nanoGPT's own ``train.py`` on its README CPU config against ``jaxgpt train``
with the same settings, start to finish (wall time of each process), and the final validation loss.

    .venv/bin/python -m scripts.benchmarks.bench_nanogpt_run [--nanogpt DIR] [--seeds 0,1,2] [--isa avx2]

DIR is a checkout of github.com/karpathy/nanoGPT, or only the folder of its ``model.py`` (the default,
``../shared/reference/nanogpt``). With a checkout, its ``train.py`` runs; without one, its loop restated
in ``nanogpt_train_loop.py`` (the same draws in the same order: at seed 0 it ends at the checkout's val
loss). The data are nanoGPT's ``data/shakespeare_char`` files: the checkout's when prepared, else
written here from ../shared/data/tinyshakespeare.txt as its prepare.py writes them. jaxgpt trains on
the same token files. Each seed is a pair of processes, nanoGPT then jaxgpt, alternating; nanoGPT's
seed is ``torch.manual_seed(1337 + seed)`` (train.py's own at seed 0), jaxgpt's ``--set seed=...``.
jaxgpt's persistent compilation cache (jaxgpt/cli/compile_cache.py) starts empty in a folder of the
benchmark's own: its first run compiles (cold), later runs load the programs (warm), as a user's
first and later runs do; both are reported. ``--isa avx2`` caps torch, XLA and the kernels at AVX2
(scripts/harness.py::isa_env) in both processes.

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

Results: results/engine/nanogpt_run{,_avx2}.{json,md}. The losses alone, under each decay grouping and
scored on the whole validation split: nanogpt_losses.py.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.harness import ISAS, RESULTS, ROOT, SHARED, LoadSampler, isa_env, timing_note, write_result

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
JAXGPT_SETS = ["n_layer=4", "n_head=4", "d_model=128", "max_len=64", "dropout=0.0", "steps=2000", "batch_size=12",
               "seq_len=64", "lr=1e-3", "warmup_steps=100", "min_lr_ratio=0.1", "beta2=0.99", "decay=matrices",
               "grad_clip=1.0", "eval_every=250", "eval_batches=20", "ckpt_every=250",
               # nanoGPT's train.py defaults to bias=False; the preset is GPT-2's, with biases
               "norm_bias=false", "qkv_bias=false", "o_bias=false", "mlp_bias=false"]


def prepare_char(text: Path, out: Path) -> Path:
    """nanoGPT's data/shakespeare_char/prepare.py: characters sorted, the first 90% train, uint16 ids."""
    data = text.read_text()
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    out.mkdir(parents=True, exist_ok=True)
    n = int(len(data) * 0.9)
    for split, part in (("train", data[:n]), ("val", data[n:])):
        np.array([stoi[ch] for ch in part], dtype=np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                                                 "stoi": stoi}))
    return out


def run_nanogpt(repo: Path, data: Path, out: Path, seed: int, env: dict, args: tuple[str, ...] = ()) -> dict:
    """``args``: more train.py flags (a checkout only; the restated loop takes none)."""
    if (repo / "train.py").is_file():  # the checkout's train.py, its seed offset by ``seed``
        shim = ("import runpy, sys, torch; seed = torch.manual_seed; "
                f"torch.manual_seed = lambda s: seed(s + {seed}); sys.argv = sys.argv[1:]; "
                "runpy.run_path('train.py', run_name='__main__')")
        cmd = [sys.executable, "-c", shim, "train.py", *NANOGPT_ARGS, *args, f"--out_dir={out}"]
        cwd = repo
    else:
        cmd = [sys.executable, "-m", "scripts.benchmarks.nanogpt_train_loop", "--nanogpt", str(repo), "--data",
               str(data), "--out", str(out), "--seed", str(seed)]
        cwd = ROOT
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"nanoGPT's loop failed:\n{r.stderr[-3000:]}")
    vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", r.stdout)
    return dict(wall_s=wall, val_loss=float(vals[-1][2]), last_eval_step=int(vals[-1][0]))


def run_jaxgpt(data: Path, out: Path, cache: Path, seed: int, env: dict, sets: tuple[str, ...] = ()) -> dict:
    """``sets``: more ``--set`` items, after JAXGPT_SETS (a later key wins)."""
    cmd = [sys.executable, "-m", "jaxgpt", "train", "--preset", "gpt2-shakespeare-char", "--data", str(data),
           "--out", str(out), "--quiet"] + [a for s in (*JAXGPT_SETS, f"seed={seed}", *sets) for a in ("--set", s)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**env, "JAXGPT_COMPILE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"jaxgpt train failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [row for row in rows if "val_loss" in row]
    return dict(wall_s=wall, val_loss=val[-1]["val_loss"], last_eval_step=val[-1].get("step"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", type=Path, default=SHARED / "reference" / "nanogpt",
                    help="a karpathy/nanoGPT checkout, or the folder of its model.py (default: %(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="comma list; one nanoGPT and one jaxgpt run each")
    ap.add_argument("--isa", choices=ISAS, default="native", help="cap torch, XLA and jaxgpt's kernels at this "
                    "instruction set in both processes (scripts/harness.py::isa_env)")
    ap.add_argument("--out", default=None, help="default: results/engine/nanogpt_run[_ISA].json")
    a = ap.parse_args(argv)
    seeds = [int(x) for x in a.seeds.split(",")]
    out_json = a.out or str(RESULTS / "engine" / f"nanogpt_run{'' if a.isa == 'native' else '_' + a.isa}.json")
    env = {**os.environ, **isa_env(a.isa)}
    load = LoadSampler()
    load.start()
    before = os.popen("uptime").read().strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = a.nanogpt / "data" / "shakespeare_char"
        if not (data / "train.bin").is_file():
            data = prepare_char(SHARED / "data" / "tinyshakespeare.txt", Path(tmp) / "shakespeare_char")
        cache = Path(tmp) / "xla"  # jaxgpt's compilation cache, empty at the start: its first run compiles
        for i, seed in enumerate(seeds):
            for name in ("nanoGPT train.py", "jaxgpt train"):
                out = Path(tmp) / f"{name.split()[0]}-{seed}"
                r = run_nanogpt(a.nanogpt, data, out, seed, env) if name.startswith("nano") else \
                    dict(run_jaxgpt(data, out, cache, seed, env), compile_cache="cold" if i == 0 else "warm")
                rows.append(r := dict(runner=name, seed=seed, **r))
                print(r, file=sys.stderr, flush=True)
    after = os.popen("uptime").read().strip()
    names = ("nanoGPT train.py", "jaxgpt train")
    med = {n: float(np.median([r["wall_s"] for r in rows if r["runner"] == n])) for n in names}
    val = {n: [r["val_loss"] for r in rows if r["runner"] == n] for n in names}
    val_mean = {n: float(np.mean(v)) for n, v in val.items()}
    val_sd = {n: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for n, v in val.items()}
    ratio = med["nanoGPT train.py"] / med["jaxgpt train"]
    gap = val_mean["jaxgpt train"] - val_mean["nanoGPT train.py"]
    cold = [r["wall_s"] for r in rows if r.get("compile_cache") == "cold"]
    warm = [r["wall_s"] for r in rows if r.get("compile_cache") == "warm"]
    loop = "train.py" if (a.nanogpt / "train.py").is_file() else "train.py's loop restated (nanogpt_train_loop.py)"
    lines = ["| runner | seed | compile cache | wall s | val loss |", "|---|---|---|---|---|"]
    lines += [f"| {r['runner']} | {r['seed']} | {r.get('compile_cache', '')} | {r['wall_s']:.1f} | {r['val_loss']:.4f} |"
              for r in rows]
    note = (f"Instruction sets: {a.isa}. nanoGPT: {loop}. Median wall: nanoGPT {med[names[0]]:.1f} s, jaxgpt "
            f"{med[names[1]]:.1f} s: jaxgpt runs at {ratio:.2f}x nanoGPT's speed; its first run, compiling, "
            f"{np.median(cold):.1f} s" + (f", later runs, loading the compiled programs, {np.median(warm):.1f} s"
                                          if warm else "")
            + f". Validation loss over {len(seeds)} seeds, mean ± sd: nanoGPT {val_mean[names[0]]:.4f} ± "
            f"{val_sd[names[0]]:.4f}, jaxgpt {val_mean[names[1]]:.4f} ± {val_sd[names[1]]:.4f} (gap {gap:+.4f}). "
            f"{timing_note(load.record())}. uptime before: `{before}`; after: `{after}`.")
    write_result(out_json, dict(rows=rows, isa=a.isa, nanogpt_loop=loop, median_wall_s=med, speed_ratio=ratio,
                                val_mean=val_mean, val_sd=val_sd, val_gap=gap, load=load.record(), note=note,
                                nanogpt_args=NANOGPT_ARGS, jaxgpt_sets=JAXGPT_SETS),
                 "\n".join(lines) + f"\n\n{note}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
