"""The ``norm`` op: LayerNorm / RMSNorm statistics over the last axis, by XLA or the C++ CPU kernel.

``impl`` (the norm_impl knob): 'xla' computes them in jax.numpy; 'ffi' runs the C++ CPU kernel
(norm_ffi.py: one read of each row); 'auto' runs 'ffi' in programs lowered for the CPU (policy.py)
where it can (the kernel built here) on inputs of native.AUTO_MIN_SIZE floats or more (training,
prefill; a decode step's few rows keep XLA's norm, fused with its neighbours), and 'xla' elsewhere.
Same numbers to 1e-6 (docs/performance.md has the speed).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxgpt.config import NORM_IMPLS
from jaxgpt.nn.kernels import native, norm_ffi, policy

__all__ = ["norm", "rsqrt"]


def norm(h, scale, bias=None, *, eps: float, center: bool, impl: str = "auto"):
    """h (..., D) float32 normalised over its last axis: (h - mean) / sqrt(var + eps) * scale + bias
    when ``center`` (LayerNorm), else h / sqrt(mean(h^2) + eps) * scale (+ bias) (RMSNorm)."""
    use = native.use_kernel("norm_impl", impl, NORM_IMPLS, h, norm_ffi.unsupported)
    return policy.cpu_kernel(use, impl == "ffi", lambda h, s, b: _ffi(h, s, b, eps, center),
                             lambda h, s, b: _xla(h, s, b, eps, center), h, scale, bias, what="norm_impl='ffi'")


def _xla(h, scale, bias, eps: float, center: bool):
    """Two-pass statistics: no E[x^2] - E[x]^2 cancellation."""
    if center:
        h = h - h.mean(-1, keepdims=True)
    y = h * rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps) * scale
    return y if bias is None else y + bias


def _ffi(h, scale, bias, eps: float, center: bool):
    return norm_ffi.layer_norm(h, scale, bias, eps=eps) if center else norm_ffi.rms_norm(h, scale, eps=eps)


def rsqrt(x):
    """1 / sqrt(x), not lax.rsqrt: XLA's rsqrt is an approximation on some backends, and torch's
    reference divides by the square root."""
    return 1.0 / jnp.sqrt(x)
