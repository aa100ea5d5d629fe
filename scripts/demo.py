"""Main job (for now): build a small Pre-LN transformer stack from jaxgpt components, run a
jitted forward/backward pass, and check KV-cached attention against full causal attention."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.attention import Attention, KVCache
from jaxgpt.block import Block
from jaxgpt.config import ModelConfig


def main() -> None:
    cfg = ModelConfig(d_model=64, n_head=4, n_kv_head=2, n_layer=4, pos="rope")
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64, cfg.d_model))
    target = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    blocks = [Block(cfg) for _ in range(cfg.n_layer)]
    params = [b.init(jax.random.PRNGKey(i), x)["params"] for i, b in enumerate(blocks)]

    @jax.jit
    def loss_and_grad(params, x):
        def loss(params):
            h = x
            for b, p in zip(blocks, params):
                h = b.apply({"params": p}, h)[0]
            return jnp.mean((h - target) ** 2)
        return jax.value_and_grad(loss)(params)

    t0 = time.perf_counter()
    value, grads = loss_and_grad(params, x)
    value.block_until_ready()
    t1 = time.perf_counter()
    value, grads = loss_and_grad(params, x)
    value.block_until_ready()
    t2 = time.perf_counter()
    gnorm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    n = sum(p.size for p in jax.tree.leaves(params))
    print(f"{cfg.n_layer} blocks, {n:,} parameters, batch {x.shape}")
    print(f"loss {float(value):.4f}  grad-norm {gnorm:.4f}  compile {t1 - t0:.2f}s  step {1e3 * (t2 - t1):.1f}ms")

    attn = Attention(d_model=64, n_head=4, n_kv_head=1, rope=True)
    p = attn.init(jax.random.PRNGKey(2), x[:1, :16])["params"]
    full = attn.apply({"params": p}, x[:1, :16], is_causal=True)[0]
    step = jax.jit(lambda c, t: attn.apply({"params": p}, t, is_causal=True, cache=c)[:2])
    cache, outs = KVCache.init(1, 1, 16, 16), []
    for i in range(16):
        y, cache = step(cache, x[:1, i:i + 1])
        outs.append(y)
    err = float(jnp.max(jnp.abs(jnp.concatenate(outs, 1) - full)))
    print(f"KV-cached decoding vs full causal attention over 16 steps: max abs error {err:.1e}")
    assert np.isfinite(float(value)) and err < 1e-5


if __name__ == "__main__":
    main()
