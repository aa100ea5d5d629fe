"""Memory (and CPU speed) of the attention backends: 'xla' (einsum, (T, T) scores) vs 'jax'
(jax.nn.dot_product_attention) vs 'blocked' (flash-style, linear in T).

    .venv/bin/python -m scripts.benchmarks.attention_memory           # T = 1k, 4k, 16k; JSON in results/engine/
    .venv/bin/python -m scripts.benchmarks.attention_memory --speed   # also time the train step at T = 256, 1024 (CPU)
    .venv/bin/python -m scripts.benchmarks.attention_memory --quick   # CI smoke: T = 256, 1024 and a short timing

Memory: the library's train step (``make_train_step``: forward, backward and the AdamW update) of a
1-layer DecoderLM (d_model 256, 4 heads, RoPE, batch 1) is lowered on abstract shapes
(jax.ShapeDtypeStruct) and compiled; XLA's ``memory_analysis()`` reports its temporaries. Nothing
of that size is allocated. Speed: the same step, run, timed A B A B across backends.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import Execution, ModelConfig, TrainConfig
from jaxgpt.train.step import abstract_state, init_state, make_train_step

IMPLS = ("xla", "jax", "blocked")


def model_config(impl: str, t: int, block: int) -> tuple[ModelConfig, Execution]:
    return (ModelConfig(vocab_size=256, d_model=256, n_layer=1, n_head=4, max_len=t, pos="rope"),
            Execution(attention_impl=impl, attention_block=block))


def train_step(config: ModelConfig, t: int, batch: int, execution: Execution):
    """The library's jitted train step (``make_train_step``, one device) for batches of ``batch`` x ``t``,
    its TrainConfig and the batch's shapes ((grad_accum, micro_batch, T) ids)."""
    tc = TrainConfig(batch_size=batch, seq_len=t, mesh="", execution=execution)
    ids = jax.ShapeDtypeStruct((1, batch, t), jnp.int32)
    return make_train_step(config, tc, mesh=None), tc, {"x": ids, "y": ids}


def temp_bytes(impl: str, t: int, batch: int, block: int) -> tuple[int, float]:
    """Temporaries (bytes) of the compiled train step, and the compile time (s)."""
    config, ex = model_config(impl, t, block)
    step, tc, shapes = train_step(config, t, batch, ex)
    start = time.perf_counter()
    compiled = step.lower(abstract_state(config, tc), shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def speed(impls, t: int, batch: int, block: int, pairs: int) -> dict:
    """Median ms per train step for each backend, timed round-robin (A B A B) on the same batch."""
    r = np.random.default_rng(0)
    data = {k: jnp.asarray(r.integers(0, 256, (1, batch, t)), jnp.int32) for k in ("x", "y")}
    runs = {}
    for impl in impls:
        config, ex = model_config(impl, t, block)
        step, tc, _ = train_step(config, t, batch, ex)
        state, metrics = step(init_state(config, tc, mesh=None), data)  # compile + warm up
        jax.block_until_ready(metrics)
        runs[impl] = [step, state]
    times = {impl: [] for impl in impls}
    for _ in range(pairs):
        for impl, run in runs.items():
            start = time.perf_counter()
            run[1], metrics = run[0](run[1], data)  # the state is donated: keep the new one
            jax.block_until_ready(metrics)
            times[impl].append((time.perf_counter() - start) * 1e3)
    return {impl: statistics.median(v) for impl, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block", type=int, default=512, help="attention_block of 'blocked'")
    ap.add_argument("--speed", action="store_true", help="also time the train step at --speed-lens")
    ap.add_argument("--speed-lens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--speed-batch", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=5, help="rounds of A B A B timing")
    ap.add_argument("--quick", action="store_true", help="CI smoke: T = 256, 1024; speed at T = 128, 2 rounds")
    ap.add_argument("--out", default=None, help="JSON written (default results/engine/attention_memory[_quick].json)")
    args = ap.parse_args()
    if args.quick:
        args.seq_lens, args.speed_lens, args.pairs, args.block = [256, 1024], [128], 2, 128
    if args.out is None:
        args.out = f"results/engine/attention_memory{'_quick' if args.quick else ''}.json"

    mib = 2.0 ** 20
    head = f"backend {jax.default_backend()}, jax {jax.__version__}, 1 layer, d_model 256, 4 heads, " \
           f"batch {args.batch_size}, attention_block {args.block}"
    print(head)
    print("| T | " + " | ".join(f"`{i}` temp MiB" for i in args.impls) + " | xla / blocked |")
    print("|---" * (len(args.impls) + 2) + "|")
    memory = []
    for t in args.seq_lens:
        row = {"T": t}
        for impl in args.impls:
            row[impl], row[f"{impl}_compile_s"] = temp_bytes(impl, t, args.batch_size, args.block)
        ratio = f"{row['xla'] / row['blocked']:.0f}x" if {"xla", "blocked"} <= set(args.impls) else "-"
        print(f"| {t:,} | " + " | ".join(f"{row[i] / mib:,.1f}" for i in args.impls) + f" | {ratio} |", flush=True)
        memory.append(row)

    timings = []
    if args.speed or args.quick:
        print(f"\ntrain step ms (median of {args.pairs} rounds, A B A B), batch {args.speed_batch}")
        print("| T | " + " | ".join(f"`{i}` ms" for i in args.impls) + " | " +
              " | ".join(f"{i} / xla" for i in args.impls if i != "xla") + " |")
        print("|---" * (2 * len(args.impls)) + "|")
        for t in args.speed_lens:
            ms = speed(args.impls, t, args.speed_batch, args.block, args.pairs)
            ratios = [f"{ms[i] / ms['xla']:.2f}" for i in args.impls if i != "xla" and "xla" in ms]
            print(f"| {t:,} | " + " | ".join(f"{ms[i]:.1f}" for i in args.impls) + " | " + " | ".join(ratios) + " |",
                  flush=True)
            timings.append({"T": t, "batch": args.speed_batch, "ms": ms})

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": head, "temp_bytes": memory, "speed": timings,
                               "device": str(jax.devices()[0])}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
