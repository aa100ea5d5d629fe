"""Soft-capping (Gemma 2): x -> cap * tanh(x / cap), a smooth clamp of attention scores
(``ModelConfig.attn_softcap``, applied before the mask) and of the final logits (``logit_softcap``)."""
from __future__ import annotations

import jax.numpy as jnp


def softcap(x, cap: float | None):
    """cap * tanh(x / cap) in x's dtype, written as HF Gemma 2 writes it; x unchanged when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def softcap_grad(capped, cap: float | None):
    """d softcap / dx from the capped values: 1 - (capped / cap)^2 (0 where capped is -inf: a masked score)."""
    if cap is None:
        return 1.0
    t = jnp.where(jnp.isfinite(capped), capped / cap, 0.0)
    return jnp.where(jnp.isfinite(capped), 1.0 - t * t, 0.0)
