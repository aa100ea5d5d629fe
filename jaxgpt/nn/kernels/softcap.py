"""Soft-capping (Gemma 2): x -> cap * tanh(x / cap), a smooth clamp of attention scores
(``ModelConfig.attn_softcap``, applied before the mask) and of the final logits (``logit_softcap``)."""
from __future__ import annotations

import jax.numpy as jnp


def softcap(x, cap: float | None):
    """cap * tanh(x / cap) in x's dtype, written as HF Gemma 2 writes it; x unchanged when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def softcap_grad(capped, cap: float):
    """d softcap / dx from the capped values: 1 - (capped / cap)^2 (0 where capped is -inf: a masked score)."""
    finite = jnp.isfinite(capped)
    t = jnp.where(finite, capped / cap, 0.0)
    return jnp.where(finite, 1.0 - t * t, 0.0)
