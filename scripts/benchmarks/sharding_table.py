"""Per-strategy memory and step time of the sharded train step on simulated CPU devices.

    python -m scripts.benchmarks.sharding_table            # llama-tiny, 8 host devices -> results/engine/sharding.json
    python -m scripts.benchmarks.sharding_table --quick    # a smaller model and fewer steps (CI smoke, < 60 s)

For DP, FSDP, TP and FSDP+TP: parameter and optimizer bytes per device (measured on the arrays'
``addressable_shards``), the median step time on the simulated mesh (8 CPU "devices" sharing
this machine's cores: NOT a speed figure), whether the compiled FSDP step all-gathers the weights
inside the layer scan's while loop (per layer) rather than before it, and an on-paper estimate of
the largest model each strategy fits on 8 x 80 GB accelerators. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from scripts.harness import RESULTS
STRATEGIES = {"DP": "data=8", "FSDP": "fsdp=8", "TP": "tensor=8", "FSDP+TP": "fsdp=4,tensor=2"}
HBM_GB, DEVICES, ACT_RESERVE_GB = 80, 8, 16  # the estimate's assumptions (see ``estimate``)


def estimate(strategy: str) -> dict:
    """Largest parameter count whose training state fits, on paper.

    Bytes per parameter (AdamW, as jaxgpt trains): float32, or bf16 compute with float32 master
    weights (ModelConfig dtype='bfloat16', param_dtype='float32'): params 4 + grads 4 + Adam m, v 8
    = 16 B (the bf16 copies are per-layer temporaries); param_dtype='bfloat16' everywhere: 8 B.
    Activations: remat='full' keeps one (B, T, d_model) residual per layer plus one layer's working
    set; ACT_RESERVE_GB per device is set aside for them and for XLA's scratch. DP replicates the
    state, every other strategy splits it 8 ways (TP: heads and MLP width; the per-layer norms
    and, with GQA, k/v projections stay whole, a few per cent).
    """
    usable = (HBM_GB - ACT_RESERVE_GB) * 1e9
    split = 1 if strategy == "DP" else DEVICES
    return {"f32_or_bf16_mixed_params_B": round(usable * split / 16 / 1e9, 1),
            "bf16_params_B": round(usable * split / 8 / 1e9, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy (after one warm-up)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps: a smoke run")
    p.add_argument("--out", default=str(RESULTS / "engine" / "sharding.json"))
    args = p.parse_args(argv)

    from jaxgpt.parallel.sharding import use_host_devices

    use_host_devices(DEVICES)
    import jax
    import numpy as np

    from jaxgpt.config import TrainConfig, get_preset
    from jaxgpt.parallel.sharding import bytes_per_device, gathers_in_scan, make_mesh, shard_batch
    from jaxgpt.train.step import init_state, make_train_step

    config = get_preset(args.preset)
    if args.quick:
        config = config.replace(d_model=64, n_layer=2, d_ff=128, vocab_size=256)
        args.batch_size, args.seq_len, args.steps = 8, 32, 2
    tc = TrainConfig(steps=100, batch_size=args.batch_size, seq_len=args.seq_len)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (1, args.batch_size, args.seq_len)).astype(np.int32)  # (A, B, T)
    batch = {"x": x, "y": np.roll(x, -1, axis=-1)}
    rows = []
    for name, spec in STRATEGIES.items():
        mesh = make_mesh(spec)
        state = init_state(config, tc, mesh=mesh)
        step = make_train_step(config, tc, mesh=mesh)
        placed = shard_batch(batch, mesh)
        hlo = step.lower(state, placed).compile().as_text()
        params_b, opt_b = max(bytes_per_device(state.params).values()), max(bytes_per_device(state.opt_state).values())
        state, m = step(state, placed)  # warm-up (compiled above; the first call also places things)
        jax.block_until_ready(m)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = step(state, placed)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        rows.append({"strategy": name, "mesh": spec, "param_bytes_per_device": params_b,
                     "opt_bytes_per_device": opt_b, "step_ms_simulated": round(1e3 * statistics.median(times), 1),
                     "all_gather_inside_layer_scan": gathers_in_scan(hlo), "loss": float(m["loss"]),
                     **estimate(name)})
        print(f"{name}: done", file=sys.stderr, flush=True)
    total = {"params": sum(a.nbytes for a in jax.tree.leaves(state.params)),
             "opt_state": sum(a.nbytes for a in jax.tree.leaves(state.opt_state))}
    report = {"preset": args.preset, "quick": args.quick, "config": config.to_dict(), "batch_size": args.batch_size,
              "seq_len": args.seq_len, "devices": f"{DEVICES} simulated CPU devices on {os.cpu_count()} cores",
              "total_bytes": total, "assumptions": {"hbm_gb": HBM_GB, "devices": DEVICES,
                                                     "activation_reserve_gb": ACT_RESERVE_GB,
                                                     "bytes_per_param": {"f32 / bf16-mixed": 16, "bf16": 8}},
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.preset}: params {total['params']:,} B, optimizer {total['opt_state']:,} B in all; "
          f"batch {args.batch_size}x{args.seq_len} on {report['devices']}\n")
    print("| strategy | mesh | params / device | optimizer / device | step (simulated, ms) | all-gather in layer scan "
          "| largest model on 8x80 GB (16 B/param) | (bf16, 8 B/param) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | `{r['mesh']}` | {r['param_bytes_per_device']:,} B "
              f"| {r['opt_bytes_per_device']:,} B "
              f"| {r['step_ms_simulated']} | {'yes' if r['all_gather_inside_layer_scan'] else 'no'} "
              f"| {r['f32_or_bf16_mixed_params_B']} B params | {r['bf16_params_B']} B params |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
