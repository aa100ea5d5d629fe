"""The logits matmul: compute-dtype inputs, float32 accumulation and output, and a backward pass
whose matmuls run in the compute dtype.

Why a custom VJP: JAX transposes ``dot_general(x_bf16, w_bf16, preferred_element_type=float32)``
into dots of the float32 cotangent with the bf16 operands, which XLA computes as float32 GEMMs
(TF32 on a GPU at best). For a GPT-2 head that is 2 x 0.95 TFLOP a step at half the bf16 rate.
torch's autocast gives its bf16 logits a bf16 gradient; so does this: the cotangent is cast to
the compute dtype before the two backward GEMMs (which still accumulate in float32). In float32
the cast is the identity and the products are JAX's own transposes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgpt.nn import precision
from jaxgpt.nn.softcap import softcap


def _dims(w_rows: bool):
    return (((1,), (1 if w_rows else 0,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, w, w_rows: bool, prec):
    return lax.dot_general(x, w, _dims(w_rows), precision=prec, preferred_element_type=jnp.float32)


def _fwd(x, w, w_rows, prec):
    return _matmul(x, w, w_rows, prec), (x, w)


def _bwd(w_rows, prec, res, g):
    x, w = res  # x (N, d); w (V, d) when w_rows, else (d, V); g (N, V) float32
    g = g.astype(x.dtype)
    dx = lax.dot_general(g, w, (((1,), (0 if w_rows else 1,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)  # (N, d)
    if w_rows:
        dw = lax.dot_general(g, x, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)  # (V, d)
    else:
        dw = lax.dot_general(x, g, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)  # (d, V)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_fwd, _bwd)


def logits_matmul(x, w, *, w_rows: bool = False):
    """x (..., d) @ w (d, V), or @ w.T for w (V, d) when ``w_rows`` (a tied embedding table) ->
    float32 (..., V). The matmuls run at the precision in force (the backward pass is traced
    after the module call returns, so it is passed along: jaxgpt.nn.precision.current)."""
    n = w.shape[0] if w_rows else w.shape[1]
    out = _matmul(x.reshape(-1, x.shape[-1]), w.astype(x.dtype), w_rows, precision.current())
    return out.reshape(*x.shape[:-1], n)


def head_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """nn.Dense's dot_general for a float32-output head: ``logits_matmul`` for the (N, d) @ (d, V)
    Dense computes (explicit ``precision``/other layouts: a float32-output lax.dot_general)."""
    if lhs.ndim == 2 and rhs.ndim == 2 and dimension_numbers == _dims(False) and precision is None:
        return logits_matmul(lhs, rhs)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)


def final_logits(config, logits):
    """The head's float32 logits (..., V) as the model gives them: soft-capped to ``config.logit_softcap``
    (Gemma 2: cap * tanh(logits / cap)), then the padded ids (>= config.valid_vocab) at the float32
    minimum (no probability, no gradient). Every logits path runs it: DecoderLM's head and the
    engine's packed panel head (inference/packed_head.py)."""
    return mask_padded(softcap(logits, config.logit_softcap), config.valid_vocab)


def mask_padded(logits, valid_vocab: int | None):
    """logits (..., V) with the ids >= valid_vocab at the float32 minimum (None: unchanged)."""
    if valid_vocab is None:
        return logits
    padded = jnp.arange(logits.shape[-1]) >= valid_vocab  # (vocab,)
    return jnp.where(padded, jnp.finfo(logits.dtype).min, logits)
