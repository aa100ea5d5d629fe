"""nanoGPT's README CPU run against ``jaxgpt train`` under each weight-decay grouping, compared by loss
only (no timings): each run's own final validation estimate, and every final model scored on the same
full validation split.

    .venv/bin/python -m scripts.benchmarks.nanogpt_losses [--nanogpt DIR] [--seeds 0,1,2]
        [--decays matrices,all] [--out results/defaults/nanogpt_decay.json]

The runs are bench_nanogpt_run's (its NANOGPT_ARGS and JAXGPT_SETS, the same data files and seeds),
one nanoGPT run and one jaxgpt run per decay per seed; ``--decays`` is set after JAXGPT_SETS
(``decay=matrices`` there: nanoGPT's grouping). The estimators differ: nanoGPT's ``estimate_loss``
averages 20 fresh random batches of 12 x 64, jaxgpt's evaluation 20 fixed windows of 12 x 64 drawn
by its seed. So each final model is also scored in JAX on the same windows, every non-overlapping
64-token window of ``val.bin`` (1742 windows, 111,488 predicted tokens): jaxgpt's from its last
checkpoint (step 2000), nanoGPT's from the model its last estimate scored (after 2000 updates:
``final.pt`` of the restated loop, or with a checkout ``ckpt.pt`` under ``--always_save_checkpoint``)
through jaxgpt.convert.nanogpt. nanoGPT's model is scored in torch too, as a check on the conversion.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from scripts.benchmarks.bench_nanogpt_run import JAXGPT_SETS, NANOGPT_ARGS, prepare_char, run_jaxgpt, run_nanogpt
from scripts.harness import RESULTS, SHARED, write_result

CHUNK = 128  # windows per scoring call


def tiled(ids: np.ndarray, t: int) -> np.ndarray:
    """Every non-overlapping (t + 1)-token window of ``ids``, starting at 0, t, 2t, ... (targets shifted by one)."""
    ids = np.asarray(ids, np.int32)
    n = (len(ids) - 1) // t
    return ids[np.arange(n)[:, None] * t + np.arange(t + 1)]


def jax_loss(config, params, windows: np.ndarray) -> float:
    """Token-mean cross entropy of ``windows`` (N, T + 1) under jaxgpt's eval step."""
    from jaxgpt.train import make_eval_step

    step = make_eval_step(config)
    total = count = 0.0
    for i in range(0, len(windows), CHUNK):
        w = windows[i:i + CHUNK]
        r = step(params, {"x": w[:, :-1], "y": w[:, 1:]})
        total, count = total + float(r["loss_sum"]), count + float(r["count"])
    return total / count


def nanogpt_model(repo: Path):
    """nanoGPT's model.py as a module of its own name (a bare ``import model`` could find another)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", repo / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_loss(repo: Path, ckpt: dict, windows: np.ndarray) -> float:
    """The same score for a nanoGPT checkpoint, in torch with nanoGPT's own model.py."""
    import torch

    nano = nanogpt_model(repo)
    model = nano.GPT(nano.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), CHUNK):
            w = torch.from_numpy(windows[i:i + CHUNK].astype(np.int64))
            _, loss = model(w[:, :-1].contiguous(), w[:, 1:].contiguous())  # mean over the chunk's tokens
            total += float(loss) * w[:, 1:].numel()
    return total / windows[:, 1:].size


def score_nanogpt(repo: Path, out: Path, windows: np.ndarray) -> dict:
    import torch

    from jaxgpt.convert.nanogpt import from_nanogpt

    path = out / "final.pt" if (out / "final.pt").is_file() else out / "ckpt.pt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    config, params = from_nanogpt(ckpt)
    return dict(val_full=jax_loss(config, params, windows), val_full_torch=torch_loss(repo, ckpt, windows))


def score_jaxgpt(out: Path, windows: np.ndarray) -> dict:
    from jaxgpt.train.checkpoint import Checkpoints

    ckpts = Checkpoints(out, create=False)
    config, params, _ = ckpts.restore_params()
    ckpts.close()
    return dict(val_full=jax_loss(config, params, windows))


def stats(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def report(rows: list[dict], seeds: list[int], loop: str, tokens: int, one_thread: bool) -> tuple[dict, str]:
    """(summary, markdown): per-seed rows, mean ± sd per side, and the paired gaps to nanoGPT."""
    sides = sorted({r["side"] for r in rows}, key=lambda s: (s != "nanoGPT", s))
    summary = {}
    for side in sides:
        own = [r for r in rows if r["side"] == side]
        summary[side] = {k: stats([r[k] for r in own]) for k in ("val_est", "val_full")}
        if side != "nanoGPT":
            nano = {r["seed"]: r for r in rows if r["side"] == "nanoGPT"}
            for k in ("val_est", "val_full"):
                summary[side][f"{k}_gap"] = stats([r[k] - nano[r["seed"]][k] for r in own])
    lines = ["| side | seed | val, own estimator | val, full split (same windows) |", "|---|---|---|---|"]
    lines += [f"| {r['side']} | {r['seed']} | {r['val_est']:.4f} | {r['val_full']:.4f} |" for r in rows]
    lines += ["", f"Mean ± sd over seeds {','.join(map(str, seeds))} (gap: jaxgpt - nanoGPT, paired by seed):", "",
              "| side | val, own estimator | val, full split | gap, own estimator | gap, full split |",
              "|---|---|---|---|---|"]
    fmt = lambda ms: f"{ms[0]:.4f} ± {ms[1]:.4f}"
    for side, s in summary.items():
        gaps = [fmt(s[f"{k}_gap"]) if f"{k}_gap" in s else "" for k in ("val_est", "val_full")]
        lines.append(f"| {side} | {fmt(s['val_est'])} | {fmt(s['val_full'])} | {' | '.join(gaps)} |")
    jax_sides = [s for s in sides if s != "nanoGPT"]
    if len(jax_sides) == 2:  # the two decays, paired by seed
        (a, b), by = jax_sides, {(r["side"], r["seed"]): r for r in rows}
        d = summary[f"{a} - {b}"] = {k: stats([by[a, s][k] - by[b, s][k] for s in seeds]) for k in ("val_est", "val_full")}
        lines.append(f"| {a} - {b}, paired | {fmt(d['val_est'])} | {fmt(d['val_full'])} | | |")
    check = max(abs(r["val_full"] - r["val_full_torch"]) for r in rows if "val_full_torch" in r)
    lines += ["", f"Estimators: *own* is each run's last evaluation (nanoGPT: `estimate_loss`, 20 fresh random batches "
              "of 12 x 64; jaxgpt: 20 fixed windows of 12 x 64 chosen by its seed). *Full split* scores every final "
              f"model in JAX on the same {tokens:,} predicted tokens (every non-overlapping 64-token window of "
              f"val.bin); nanoGPT's models scored in torch agree with their JAX scores to {check:.1e}. nanoGPT: "
              f"{loop}. jaxgpt: `jaxgpt train --preset gpt2-shakespeare-char` with bench_nanogpt_run's JAXGPT_SETS "
              "and the decay named." + (" One compute thread per run (`--one-thread`)." if one_thread else "")]
    return summary, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", type=Path, default=SHARED / "reference" / "nanogpt",
                    help="a karpathy/nanoGPT checkout, or the folder of its model.py (default: %(default)s)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--decays", default="matrices,all", help="jaxgpt's TrainConfig.decay values, one run each")
    ap.add_argument("--one-thread", action="store_true", help="one compute thread for torch and XLA in every run "
                    "(a shared machine: oversubscribed threads spin; the losses move by rounding only)")
    ap.add_argument("--out", default=str(RESULTS / "defaults" / "nanogpt_decay.json"))
    a = ap.parse_args(argv)
    seeds, decays = [int(x) for x in a.seeds.split(",")], a.decays.split(",")
    checkout = (a.nanogpt / "train.py").is_file()
    loop = "train.py" if checkout else "train.py's loop restated (nanogpt_train_loop.py)"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = a.nanogpt / "data" / "shakespeare_char"
        if not (data / "train.bin").is_file():
            data = prepare_char(SHARED / "data" / "tinyshakespeare.txt", Path(tmp) / "shakespeare_char")
        windows = tiled(np.fromfile(data / "val.bin", dtype=np.uint16), 64)
        cache, env = Path(tmp) / "xla", dict(os.environ)
        if a.one_thread:  # scripts/harness.py::single_thread, for the child processes
            env.update(OMP_NUM_THREADS="1", XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false")
        for seed in seeds:
            out = Path(tmp) / f"nanogpt-{seed}"
            r = run_nanogpt(a.nanogpt, data, out, seed, env, ("--always_save_checkpoint=True",) if checkout else ())
            rows.append(dict(side="nanoGPT", seed=seed, val_est=r["val_loss"], **score_nanogpt(a.nanogpt, out, windows)))
            print(rows[-1], file=sys.stderr, flush=True)
            for decay in decays:
                out = Path(tmp) / f"jaxgpt-{decay}-{seed}"
                r = run_jaxgpt(data, out, cache, seed, env, (f"decay={decay}",))
                rows.append(dict(side=f"jaxgpt decay={decay}", seed=seed, val_est=r["val_loss"],
                                 **score_jaxgpt(out, windows)))
                print(rows[-1], file=sys.stderr, flush=True)
    tokens = int(windows[:, 1:].size)
    summary, table = report(rows, seeds, loop, tokens, a.one_thread)
    write_result(a.out, dict(rows=rows, summary=summary, seeds=seeds, decays=decays, nanogpt_loop=loop, one_thread=a.one_thread,
                             val_full_windows=len(windows), val_full_tokens=tokens, nanogpt_args=NANOGPT_ARGS,
                             jaxgpt_sets=JAXGPT_SETS), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
