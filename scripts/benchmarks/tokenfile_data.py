"""Token files at scale: peak RSS of `jaxgpt train --data DIR` on a 3 GB train.bin against a 3 MB
one (memory-mapped: the two should match), and the loader's batches/s against the training step.

    python -m scripts.benchmarks.tokenfile_data                 # 3 GB, results/tokenfiles/
    python -m scripts.benchmarks.tokenfile_data --size-gb 0.1 --out /tmp/t.json   # quick

The big file is sparse (``truncate``: zeros, which are valid ids; no disk space used), so the
loader timing measures its CPU cost (window draws, memmap fancy indexing, int32 casts) from the
page cache, not the disk. Each training run is its own process, which reports its peak RSS from
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after training. The model and its batch are tiny (CPU;
float32 logits B x T x 50257 dominate the RSS above JAX's own): the RSS is jaxgpt + JAX + the
model + what the data costs, and the data's share is the part that must not grow with the file.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from scripts.harness import RESULTS, LoadSampler, report, spawn, timing_note, write_result

VOCAB = 50257  # GPT-2's, so the files are uint16 as OpenWebText's are
SETS = ["n_layer=2", "d_model=64", "d_ff=256", "n_head=2", "batch_size=4", "seq_len=128", "steps=12", "eval_every=0",
        "eval_batches=2", "log_every=4", "ckpt_every=0"]
LOADER_SHAPES = [(12, 1024), (480, 1024)]  # nanoGPT's GPT-2 micro-batch, and its 491,520-token step


def make_dir(d: Path, n_tokens: int, sparse: bool) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    import numpy as np

    if sparse:
        with open(d / "train.bin", "wb") as f:
            f.truncate(2 * n_tokens)
    else:
        np.random.default_rng(0).integers(0, VOCAB, n_tokens).astype(np.uint16).tofile(d / "train.bin")
    np.random.default_rng(1).integers(0, VOCAB, 100_000).astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16", "tokenizer": None}))
    return d


def worker(data: str, out: str) -> None:
    """One training run; reports peak RSS and the steady-state step time."""
    import contextlib
    import io

    from jaxgpt.cli import main

    buf = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = main(["train", "--preset", "seed-minigpt", "--data", data, *[a for s in SETS for a in ("--set", s)],
                   "--quiet", "--out", out])
    wall = time.perf_counter() - t
    rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    ms = sorted(1e3 * 4 * 128 / r["tok_s"] for r in rows if "tok_s" in r)[1:]  # the first row: compilation
    report({"rc": rc, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "wall_s": wall,
            "step_ms": ms[len(ms) // 2] if ms else None, "out": buf.getvalue()[-300:]})


def loader(data: str) -> None:
    """Batches/s of TokenTask.batch (one process, all rows) at nanoGPT's GPT-2 shapes."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.token_task import token_task

    out = {}
    for b, t in LOADER_SHAPES:
        tc = TrainConfig(batch_size=b, seq_len=t, val_fraction=0.0)
        task = token_task(data, tc, check="none")
        task.batch(tc, 0)
        n = max(5, 2000 // b)
        t0 = time.perf_counter()
        for s in range(1, n + 1):
            task.batch(tc, s)
        sec = (time.perf_counter() - t0) / n
        out[f"{b}x{t}"] = {"batches_per_s": round(1 / sec, 1), "ms_per_batch": round(1e3 * sec, 2),
                           "tokens_per_s": round(b * t / sec)}
    report({"loader": out, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=3.0)
    p.add_argument("--out", default=str(RESULTS / "tokenfiles" / "data.json"))
    p.add_argument("--worker", nargs=2, metavar=("DATA", "OUT"))
    p.add_argument("--loader", metavar="DATA")
    a = p.parse_args()
    if a.worker:
        return worker(*a.worker)
    if a.loader:
        return loader(a.loader)
    load = LoadSampler()
    load.start()
    uptime_before = os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = make_dir(tmp / "big", int(a.size_gb * 2 ** 30) // 2, sparse=True)
        small = make_dir(tmp / "small", 1_500_000, sparse=False)
        runs = {name: spawn("scripts.benchmarks.tokenfile_data", "--worker", d, tmp / f"run-{name}", timeout=600)
                for name, d in (("3MB", small), ("big", big))}
        ld = spawn("scripts.benchmarks.tokenfile_data", "--loader", big, timeout=600)
        size = (big / "train.bin").stat().st_size
    rec = load.record()
    result = {"train_bin_bytes": size, "runs": runs, "loader": ld, "load": rec, "uptime_before": uptime_before,
              "uptime_after": os.popen("uptime").read().strip(), "note": timing_note(rec), "sets": SETS}
    step = runs["big"].get("step_ms")
    lines = [f"Token files: `jaxgpt train --data DIR` peak RSS and loader speed ({timing_note(rec)}; "
             f"`python -m scripts.benchmarks.tokenfile_data`).", "",
             "| train.bin | peak RSS (MB) | step (ms, tiny model 4x128) |", "|---|---|---|"]
    for name, label in (("3MB", "3 MB (random ids)"), ("big", f"{size / 2 ** 30:.2f} GiB (sparse)")):
        r = runs[name]
        lines.append(f"| {label} | {r.get('peak_rss_mb', float('nan')):.0f} | {r.get('step_ms') or float('nan'):.1f} |")
    lines += ["", "| loader batch (B x T) | batches/s | ms/batch | tokens/s |", "|---|---|---|---|"]
    for shape, v in ld.get("loader", {}).items():
        lines.append(f"| {shape} | {v['batches_per_s']} | {v['ms_per_batch']} | {v['tokens_per_s']:,} |")
    per = ld.get("loader", {}).get("12x1024", {}).get("ms_per_batch")
    if step and per:
        lines += ["", f"Loader: {per} ms for a 12x1024 batch (24x the tokens of the tiny model's 4x128 batch), against "
                  f"{step:.1f} ms for the tiny model's training step; the batch is built on the prefetch thread, "
                  "ahead of the step. GPT-2 124M's step is far longer than either."]
    write_result(a.out, result, "\n".join(lines))


if __name__ == "__main__":
    main()
