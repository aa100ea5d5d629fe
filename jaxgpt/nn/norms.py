"""LayerNorm and RMSNorm with explicit eps and two-pass statistics (``kernels.norm``; ``impl``,
``Execution.norm_impl``, picks XLA or the C++ CPU kernel, the same numbers to 1e-6).

Flax's own ``nn.LayerNorm`` defaults to eps=1e-6 and a one-pass (fast) variance; both break
1e-5 parity with torch, so the statistics are written out here. Statistics (and the scale and
bias products) are computed in float32 whatever the input dtype: a bfloat16 mean/variance over
d_model values loses about 3 digits. Scale and bias are stored in ``param_dtype``; the result is
cast to ``dtype`` (None: the input's dtype), the compute dtype of the layer that reads it.
"""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config import Execution
from jaxgpt.config.execution import DEFAULT_EXECUTION
from jaxgpt.nn.kernels.norm import norm, rsqrt as jax_rsqrt  # noqa: F401  (jax_rsqrt: a public name)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis. x: (..., D)."""

    eps: float = 1e-5
    use_bias: bool = True
    dtype: str | None = None  # output dtype (None: x.dtype)
    param_dtype: str = "float32"
    impl: str = "auto"  # NORM_IMPLS
    # Gemma's RMSNorm: the stored ``scale`` w (initialised to 0) scales by (1 + w), added in float32
    unit_offset: bool = False
    center: ClassVar[bool] = True  # subtract the mean first (RMSNorm: no)

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = x.astype(jnp.float32)
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (d,), self.param_dtype).astype(jnp.float32)
        if self.unit_offset:
            scale = 1.0 + scale
        bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype).astype(jnp.float32) \
            if self.use_bias else None
        y = norm(h, scale, bias, eps=self.eps, center=self.center, impl=self.impl)
        return y.astype(self.dtype or x.dtype)


class RMSNorm(LayerNorm):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis, no bias. x: (..., D)."""

    eps: float = 1e-6
    use_bias: bool = False
    center: ClassVar[bool] = False

    def __post_init__(self):
        if self.use_bias:
            raise ValueError("RMSNorm has no bias (use_bias=True); a biased norm is LayerNorm's")
        super().__post_init__()


def make_norm(kind: str, eps: float, use_bias: bool = True, name: str | None = None, *,
              dtype: str | None = None, param_dtype: str = "float32", impl: str = "auto",
              unit_offset: bool = False) -> nn.Module:
    """The norm a config names: 'layernorm' or 'rmsnorm' (``unit_offset``: scale by 1 + scale)."""
    kw = dict(eps=eps, dtype=dtype, param_dtype=param_dtype, impl=impl, unit_offset=unit_offset, name=name)
    if kind == "layernorm":
        return LayerNorm(use_bias=use_bias, **kw)
    if kind == "rmsnorm":
        return RMSNorm(**kw)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


def norm_from_config(config, name: str, execution: Execution = DEFAULT_EXECUTION) -> nn.Module:
    """The norm a ModelConfig names, with its precision policy (output in the compute dtype), run with
    ``execution``'s kernel."""
    return make_norm(config.norm, config.norm_eps, config.norm_bias, name=name, dtype=config.dtype,
                     param_dtype=config.param_dtype, impl=execution.norm_impl, unit_offset=config.norm_unit_offset)
