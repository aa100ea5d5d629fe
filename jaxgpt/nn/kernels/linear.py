"""The ``linear`` op: x (..., in) @ w (in, out) + b, and the logits head, with their speed paths.

Every projection of the models (nn/mlp.py ``Dense``) and the vocabulary head run here:

- The rows: x is flattened to the (N, in) matrix before the dot. For a (B, T, in) input XLA:CPU
  computes the kernel gradient through a strided transposed buffer; the matrix form is faster
  (docs/performance.md).
- The narrowing gradient: in a program lowered for the CPU, for in > out the kernel gradient is
  computed as (out, in) = dy^T x and transposed, the form Eigen's GEMM writes faster (``_narrowing``).
- The matvec: in a program lowered for the CPU, a few float32 rows (a decode step's) run the two-thread
  matvec kernel (matvec_ffi.applies: the rows, the dtype, the kernel built and calibrated faster here)
  on weights that are whole arrays: a custom call cannot read a slice of stacked layers' weights in
  place and would copy it every step, so a layer stack traces its scanned body in ``stacked_weights()``.
- The logits head (``logits``): compute-dtype inputs, float32 accumulation and output, and a backward
  pass whose matmuls run in the compute dtype. JAX transposes ``dot_general(x_bf16, w_bf16,
  preferred_element_type=float32)`` into float32 GEMMs; torch's autocast gives bf16 logits a bf16
  gradient, and so does this: the cotangent is cast to the compute dtype before the two backward
  GEMMs (which still accumulate in float32). In float32 the cast is the identity.

Same products everywhere; only summation orders differ (float rounding). The matmuls run at the
precision in force (nn/kernels/precision.py); custom gradients pass it along, their backward pass being
traced after the module call returns.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels import matvec_ffi, policy

__all__ = ["linear", "logits", "stacked_weights"]

_STACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxgpt_stacked_weights", default=False)


@contextlib.contextmanager
def stacked_weights():
    """Trace the enclosed layers as slices of stacked weights (an nn.scan over layers): no matvec."""
    token = _STACKED.set(True)
    try:
        yield
    finally:
        _STACKED.reset(token)


def linear(x, w, b=None, *, dtype="float32", f32_out: bool = False):
    """x (..., in) @ w (in, out) + b (out,) -> (..., out), computed in ``dtype`` (x, w and b cast to it).
    ``f32_out``: accumulate and return float32 whatever ``dtype`` is (a logits head)."""
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    rows = x.reshape(-1, x.shape[-1])  # (N, in)
    y = _logits(rows, w, False, precision.current()) if f32_out else _rows(rows, w)  # (N, out)
    if b is not None:
        y = y + jnp.asarray(b, dtype)
    return y.reshape(*x.shape[:-1], w.shape[1])


def logits(x, w, *, w_rows: bool = False):
    """x (..., d) @ w (d, V), or @ w.T for w (V, d) when ``w_rows`` (a tied embedding table) -> float32
    (..., V), by the logits head's matmul (module docstring)."""
    n = w.shape[0] if w_rows else w.shape[1]
    out = _logits(x.reshape(-1, x.shape[-1]), w.astype(x.dtype), w_rows, precision.current())
    return out.reshape(*x.shape[:-1], n)


def _dot(x, w):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())))


def _rows(x, w):
    """x (N, in) @ w (in, out): the matvec kernel, the narrowing gradient or XLA's dot."""
    use = not _STACKED.get() and matvec_ffi.applies(x, w)
    return policy.cpu_kernel(use, False, matvec_ffi.matvec, _portable_rows, x, w)


def _portable_rows(x, w):
    if w.shape[0] > w.shape[1]:
        return policy.on_cpu(functools.partial(_narrowing, prec=precision.current()), _dot, x, w)
    return _dot(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _narrowing(x, w, prec):
    """x (N, in) @ w (in, out) for in > out, whose kernel gradient is computed as (out, in) and
    transposed; the optimization barrier keeps XLA from folding the transpose back into the dot."""
    return x @ w


def _narrowing_fwd(x, w, prec):
    return x @ w, (x, w)


def _narrowing_bwd(prec, res, dy):
    x, w = res
    dx = lax.dot_general(dy, w, (((1,), (1,)), ((), ())), precision=prec)  # (N, in)
    dw = lax.optimization_barrier(lax.dot_general(dy, x, (((0,), (0,)), ((), ())), precision=prec))  # (out, in)
    return dx, dw.T


_narrowing.defvjp(_narrowing_fwd, _narrowing_bwd)


def _dims(w_rows: bool):
    return (((1,), (1 if w_rows else 0,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logits(x, w, w_rows: bool, prec):
    return lax.dot_general(x, w, _dims(w_rows), precision=prec, preferred_element_type=jnp.float32)


def _logits_fwd(x, w, w_rows, prec):
    return _logits(x, w, w_rows, prec), (x, w)


def _logits_bwd(w_rows, prec, res, g):
    x, w = res  # x (N, d); w (V, d) when w_rows, else (d, V); g (N, V) float32
    g = g.astype(x.dtype)
    f32 = dict(precision=prec, preferred_element_type=jnp.float32)
    dx = lax.dot_general(g, w, (((1,), (0 if w_rows else 1,)), ((), ())), **f32)  # (N, d)
    if w_rows:
        dw = lax.dot_general(g, x, (((0,), (0,)), ((), ())), **f32)  # (V, d)
    else:
        dw = lax.dot_general(x, g, (((0,), (0,)), ((), ())), **f32)  # (d, V)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)
