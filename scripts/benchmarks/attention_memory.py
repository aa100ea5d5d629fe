"""Memory (and CPU speed) of the attention backends: 'xla' (einsum, (T, T) scores) vs 'jax'
(jax.nn.dot_product_attention) vs 'blocked' (flash-style, linear in T).

    .venv/bin/python -m scripts.benchmarks.attention_memory           # T = 1k, 4k, 16k; JSON in results/engine/
    .venv/bin/python -m scripts.benchmarks.attention_memory --speed   # also time fwd+bwd at T = 256, 1024 (CPU)
    .venv/bin/python -m scripts.benchmarks.attention_memory --quick   # CI smoke: T = 256, 1024 and a short timing

Memory: the forward + backward of a 1-layer DecoderLM's loss (d_model 256, 4 heads, RoPE, batch 1; the
train step without the optimizer, whose state does not depend on T) is lowered on abstract shapes
(jax.ShapeDtypeStruct) and compiled; XLA's ``memory_analysis()`` reports its temporaries. Nothing
of that size is allocated. Speed: the same function, run, timed A B A B across backends.
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

from jaxgpt import build
from jaxgpt.config import ModelConfig
from jaxgpt.models import abstract_params

IMPLS = ("xla", "jax", "blocked")


def model_config(impl: str, t: int, block: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=256, n_layer=1, n_head=4, max_len=t, pos="rope", attention_impl=impl,
                       attention_block=block)


def loss_and_grads(config: ModelConfig):
    model = build(config)

    def loss(params, x, y):  # x, y: (B, T) token ids
        logits = model.apply({"params": params}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))

    return jax.jit(jax.value_and_grad(loss))


def temp_bytes(impl: str, t: int, batch: int, block: int) -> tuple[int, float]:
    """Temporaries (bytes) of the compiled fwd+bwd, and the compile time (s)."""
    config = model_config(impl, t, block)
    ids = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    start = time.perf_counter()
    compiled = loss_and_grads(config).lower(abstract_params(config), ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def speed(impls, t: int, batch: int, block: int, pairs: int) -> dict:
    """Median ms per fwd+bwd for each backend, timed round-robin (A B A B) on the same inputs."""
    r = np.random.default_rng(0)
    x, y = (jnp.asarray(r.integers(0, 256, (batch, t)), jnp.int32) for _ in range(2))
    runs = {}
    for impl in impls:
        config = model_config(impl, t, block)
        params = build(config).init(jax.random.PRNGKey(0), x[:, :1])["params"]
        fn = loss_and_grads(config)
        jax.block_until_ready(fn(params, x, y))  # compile + warm up
        runs[impl] = (fn, params)
    times = {impl: [] for impl in impls}
    for _ in range(pairs):
        for impl, (fn, params) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, x, y))
            times[impl].append((time.perf_counter() - start) * 1e3)
    return {impl: statistics.median(v) for impl, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block", type=int, default=512, help="attention_block of 'blocked'")
    ap.add_argument("--speed", action="store_true", help="also time fwd+bwd at --speed-lens")
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
        print(f"\nfwd+bwd ms (median of {args.pairs} rounds, A B A B), batch {args.speed_batch}")
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
