"""Train-step time of the layer-stack settings (scan / unrolled / separate layers / remat).

    .venv/bin/python -m scripts.benchmarks.scan_timing                  # seed-minigpt, batch 32 x 64, 30 steps each

Each setting's jitted train step (``make_train_step``: forward, backward, AdamW, clipping) is
compiled and warmed up, then the settings are timed in interleaved rounds (so load from other
processes hits all of them alike) and the median step time is reported, with the ratio to the
default (scanned, rolled) stack.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from jaxgpt.config import Execution, TrainConfig, get_preset
from jaxgpt.train.step import init_state, make_train_step
from scripts.harness import step_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="seed-minigpt")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per setting (median reported)")
    args = ap.parse_args()
    base = get_preset(args.preset)
    tc = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    settings = {"scan (default)": {}, f"scan_unroll={base.n_layer}": {"scan_unroll": base.n_layer},
                "scan_layers=False": {"scan_layers": False}, "remat=full": {"remat": "full"}}
    rng = np.random.default_rng(0)
    x = rng.integers(0, base.vocab_size, (1, tc.batch_size, tc.seq_len), dtype=np.int32)  # (A, B, T)
    batch = {"x": x, "y": np.roll(x, -1, axis=-1)}
    runs = {}
    for name, kw in settings.items():
        config, tcx = base, tc.replace(execution=Execution(**kw))
        step, state = make_train_step(config, tcx), init_state(config, tcx)
        state, _, (first,) = step_times(step, state, [batch], warm=0, sync=jax.block_until_ready)
        runs[name] = [step, state, [], first]
    for _ in range(args.steps):  # A B A B: one step of each setting a round
        for run in runs.values():
            run[1], _, seconds = step_times(run[0], run[1], [batch], warm=0, sync=jax.block_until_ready)
            run[2] += seconds
    ref = statistics.median(runs["scan (default)"][2])
    print(f"{args.preset}, batch {tc.batch_size} x {tc.seq_len}, median of {args.steps} steps, "
          f"backend {jax.default_backend()}")
    print("| layer stack | first step (compile) s | median step ms | speed vs scan |")
    print("|---|---|---|---|")
    for name, (_, _, times, first) in runs.items():
        med = statistics.median(times)
        print(f"| {name} | {first:.1f} | {1e3 * med:.1f} | {ref / med:.2f}x |")


if __name__ == "__main__":
    main()
