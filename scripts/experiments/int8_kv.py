"""int8 KV cache (absmax scales per token and head) against float32 and bfloat16 pools, on a
briefly trained Tiny Shakespeare character model.

    .venv/bin/python -m scripts.experiments.int8_kv            # -> results/engine/int8_kv.{json,md}
    .venv/bin/python -m scripts.experiments.int8_kv --steps 50 # quicker, worse model

Trains a 4-layer, 128-wide character LLaMA (RoPE, context 256) with AdamW for ``--steps``
steps, then through the paged attention path (jaxgpt/nn/kernels/paged.py) measures: pool bytes
per token; the max and mean |logit error| of each KV dtype against float32 pools on held-out
256-character windows; validation perplexity; and how many of 32 greedy continuations (the
Engine, 64 tokens each) stay token-identical to the float32 ones.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from scripts.harness import RESULTS, LoadSampler, timing_note, write_result


def train_char_model(cfg, steps: int, seed: int = 0, batch: int = 16, lr: float = 3e-3):
    """A briefly trained character model on Tiny Shakespeare: (params, final loss, validation ids).

    The library's one loop (``expkit.train``: ``fit`` with its batch checks and NaN stop), constant
    AdamW at ``lr`` (3e-3) (weight decay 0.1, no clipping), windows of ``cfg.max_len`` characters; the
    validation ids are the text's last 10% (sorted-character ids, as the tokenizer numbers them)."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.tasks import load_task

    from scripts.experiments.expkit import shakespeare, train

    tc = TrainConfig(steps=steps, batch_size=batch, seq_len=cfg.max_len, lr=lr, schedule="constant",
                     beta2=0.999, weight_decay=0.1, grad_clip=None, seed=seed, eval_every=0, eval_batches=1,
                     log_every=min(50, steps), mesh="")
    task = load_task(cfg, tc, data=str(shakespeare()))
    if task.tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"vocab_size={cfg.vocab_size}, but Tiny Shakespeare has {task.tokenizer.vocab_size} characters")
    t0 = time.perf_counter()
    r = train(cfg, tc, task)
    loss = [row["loss"] for row in r["history"] if "loss" in row][-1]
    print(f"trained {cfg.n_layer}x{cfg.d_model} for {steps} steps in {time.perf_counter() - t0:.0f}s, "
          f"final loss {loss:.3f}")
    return r["params"], float(loss), np.asarray(task.val[0])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(RESULTS / "engine" / "int8_kv.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jaxgpt.config import ModelConfig
    from jaxgpt.inference.engine import Engine
    from jaxgpt.inference.paged_cache import init_pools, pool_bytes
    from jaxgpt.inference.sampling import SamplingParams
    from jaxgpt.models.decoder import DecoderLM
    from jaxgpt.nn.kernels.paged import PagedKVCache

    load = LoadSampler()
    load.start()
    t = 256
    cfg = ModelConfig(vocab_size=65, d_model=128, n_layer=4, n_head=4, max_len=t, pos="rope")  # decoded as separate layers
    params, loss, val = train_char_model(cfg, a.steps)
    # Held-out windows through the paged path: pages 1.. per row, every key read back from the pool.
    n_win, ps = 16, 16
    wins = np.stack([val[i * t:(i + 1) * t + 1] for i in range(n_win)])
    x, y = wins[:, :-1], wins[:, 1:]
    p = t // ps
    table = 1 + np.arange(n_win * p, dtype=np.int32).reshape(n_win, p)
    pos = np.tile(np.arange(t, dtype=np.int32), (n_win, 1))
    slots = table[:, pos[0] // ps] * ps + pos % ps

    @jax.jit
    def paged_logits(params, pools, x):
        caches = tuple(PagedKVCache(k, v, table, slots, pos, ks, vs, cfg.dtype) for k, v, ks, vs in pools)
        return DecoderLM(cfg).apply({"params": params}, x, positions=pos, cache=caches).logits

    rows, ref = [], None
    for kv in ("float32", "bfloat16", "int8"):
        pools = init_pools(cfg, 1 + n_win * p, ps, kv)
        logits = np.asarray(paged_logits(params, pools, jnp.asarray(x)), np.float64)
        if ref is None:
            ref = logits
        lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        nll = -np.take_along_axis(lp, y[..., None], -1).mean()
        rows.append(dict(kv_dtype=kv, bytes_per_token=pool_bytes(pools) / ((1 + n_win * p) * ps),
                         logit_err_max=float(np.abs(logits - ref).max()),
                         logit_err_mean=float(np.abs(logits - ref).mean()), val_ppl=float(np.exp(nll))))

    prompts = [list(val[i * 97:i * 97 + 32]) for i in range(32)]
    outs = {}
    for kv in ("float32", "bfloat16", "int8"):
        eng = Engine(cfg, params, max_seqs=32, page_size=ps, max_tokens_per_step=1024, kv_dtype=kv)
        outs[kv] = eng.generate(prompts, SamplingParams(max_tokens=64))
    for r in rows:
        same = [o == f for o, f in zip(outs[r["kv_dtype"]], outs["float32"])]
        first = [next((i for i, (u, w) in enumerate(zip(o, f)) if u != w), len(f))
                 for o, f in zip(outs[r["kv_dtype"]], outs["float32"])]
        r["greedy_identical"] = f"{sum(same)}/{len(same)}"
        r["tokens_before_divergence_mean"] = float(np.mean(first))

    base = rows[0]
    lines = ["| KV dtype | bytes / token (all layers, K+V) | vs float32 | max abs logit error | mean abs logit error | "
             "val perplexity | change | greedy identical (64 tokens) | mean tokens before divergence |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kv_dtype']} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / base['bytes_per_token']:.2f}x"
                     f" | {r['logit_err_max']:.2e} | {r['logit_err_mean']:.2e} | {r['val_ppl']:.4f} | "
                     f"{r['val_ppl'] - base['val_ppl']:+.4f} | {r['greedy_identical']} | "
                     f"{r['tokens_before_divergence_mean']:.1f} |")
    note = (f"Character LLaMA 4x128 (context {t}) trained {a.steps} AdamW steps (final train loss {float(loss):.3f}); "
            f"{n_win} held-out windows of {t} characters; {timing_note(load.record())}.")
    write_result(a.out, {"rows": rows, "steps": a.steps, "train_loss": float(loss), "note": note},
                 "\n".join(lines) + f"\n\n{note}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
