"""LayerNorm and RMSNorm with explicit eps and two-pass statistics.

Flax's own ``nn.LayerNorm`` defaults to eps=1e-6 and a one-pass (fast) variance; both break
1e-5 parity with torch, so the statistics are written out here. Statistics are computed in
float32 whatever the input dtype; the result is cast back.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis. x: (..., D)."""

    eps: float = 1e-5
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)  # two-pass: no E[x^2]-E[x]^2 cancellation
        y = (h - mean) * jax_rsqrt(var + self.eps)
        y = y * self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis. x: (..., D)."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        y = h * jax_rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        y = y * self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        return y.astype(x.dtype)


def jax_rsqrt(x):
    # 1/sqrt rather than lax.rsqrt: XLA's rsqrt is an approximation on some backends, and
    # torch's reference divides by the square root.
    return 1.0 / jnp.sqrt(x)


def make_norm(kind: str, eps: float, use_bias: bool = True, name: str | None = None) -> nn.Module:
    """The norm a config names: 'layernorm' or 'rmsnorm'."""
    if kind == "layernorm":
        return LayerNorm(eps=eps, use_bias=use_bias, name=name)
    if kind == "rmsnorm":
        return RMSNorm(eps=eps, name=name)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")
