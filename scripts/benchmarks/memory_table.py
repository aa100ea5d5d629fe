"""Memory of the compiled train step per ``remat`` policy, from XLA's ``memory_analysis()``.

    .venv/bin/python -m scripts.benchmarks.memory_table                       # gpt2-small, B 8, T 1024
    .venv/bin/python -m scripts.benchmarks.memory_table --n-layer 2 --batch-size 2 --seq-len 128

Nothing is allocated or run: the train step (``jaxgpt.train.step.make_train_step``: forward,
backward, AdamW, clipping) is lowered on abstract shapes and compiled for the default backend,
and XLA reports the bytes of its arguments, outputs and temporaries (the activations kept for the
backward pass live in the temporaries). Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxgpt.config import REMATS, Execution, TrainConfig, get_preset
from jaxgpt.data import batch_keys
from jaxgpt.train.step import abstract_state, make_train_step


def compiled_memory(config, tc: TrainConfig) -> dict:
    """{'temp', 'argument', 'output', 'compile_s'} of the train step compiled for ``config``, ``tc``."""
    state = abstract_state(config, tc)
    shape = (tc.grad_accum, tc.micro_batch, tc.seq_len)  # (A, B / A, T): x and y token ids
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in batch_keys(config)}
    t = time.perf_counter()
    mem = make_train_step(config, tc).lower(state, batch).compile().memory_analysis()
    return {"temp": mem.temp_size_in_bytes, "argument": mem.argument_size_in_bytes,
            "output": mem.output_size_in_bytes, "compile_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=None, help="fewer layers than the preset (compile time)")
    ap.add_argument("--remat", nargs="+", default=list(REMATS), choices=REMATS)
    args = ap.parse_args()
    config = get_preset(args.preset)
    if args.n_layer is not None:
        config = config.replace(n_layer=args.n_layer)
    tc = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    mib = 2.0 ** 20
    print(f"{args.preset} (n_layer {config.n_layer}), batch {args.batch_size} x {args.seq_len}, "
          f"backend {jax.default_backend()}, jax {jax.__version__}")
    print("| remat | temp MiB | argument MiB | output MiB | compile s |")
    print("|---|---|---|---|---|")
    for policy in args.remat:
        m = compiled_memory(config, tc.replace(execution=Execution(remat=policy)))
        print(f"| `{policy}` | {m['temp'] / mib:,.0f} | {m['argument'] / mib:,.0f} | {m['output'] / mib:,.0f} "
              f"| {m['compile_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
