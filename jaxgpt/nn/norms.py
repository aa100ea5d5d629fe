"""LayerNorm and RMSNorm with explicit eps and two-pass statistics.

Flax's own ``nn.LayerNorm`` defaults to eps=1e-6 and a one-pass (fast) variance; both break
1e-5 parity with torch, so the statistics are written out here. Statistics (and the scale and
bias products) are computed in float32 whatever the input dtype: a bfloat16 mean/variance over
d_model values loses about 3 digits. Scale and bias are stored in ``param_dtype``; the result is
cast to ``dtype`` (None: the input's dtype), the compute dtype of the layer that reads it.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis. x: (..., D)."""

    eps: float = 1e-5
    use_bias: bool = True
    dtype: str | None = None  # output dtype (None: x.dtype)
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)  # two-pass: no E[x^2]-E[x]^2 cancellation
        y = (h - mean) * jax_rsqrt(var + self.eps)
        y = y * self.param("scale", nn.initializers.ones, (d,), self.param_dtype).astype(jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(jnp.float32)
        return y.astype(self.dtype or x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis. x: (..., D)."""

    eps: float = 1e-6
    dtype: str | None = None  # output dtype (None: x.dtype)
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        y = h * jax_rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        y = y * self.param("scale", nn.initializers.ones, (d,), self.param_dtype).astype(jnp.float32)
        return y.astype(self.dtype or x.dtype)


def jax_rsqrt(x):
    # 1/sqrt rather than lax.rsqrt: XLA's rsqrt is an approximation on some backends, and
    # torch's reference divides by the square root.
    return 1.0 / jnp.sqrt(x)


def make_norm(kind: str, eps: float, use_bias: bool = True, name: str | None = None, *,
              dtype: str | None = None, param_dtype: str = "float32") -> nn.Module:
    """The norm a config names: 'layernorm' or 'rmsnorm'."""
    if kind == "layernorm":
        return LayerNorm(eps=eps, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, name=name)
    if kind == "rmsnorm":
        return RMSNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


def norm_from_config(config, name: str) -> nn.Module:
    """The norm a ModelConfig names, with its precision policy (output in the compute dtype)."""
    return make_norm(config.norm, config.norm_eps, config.norm_bias, name=name, dtype=config.dtype,
                     param_dtype=config.param_dtype)
