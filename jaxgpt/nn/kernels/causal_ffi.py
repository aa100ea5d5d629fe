"""attention_impl='ffi': causal self-attention for CPU training as two XLA FFI custom calls
(cpu/causal_attention.cc), forward and backward, under a ``jax.custom_vjp``.

Why native code: a short-sequence attention layer is a dozen small XLA:CPU thunks per direction
(scores, mask select, max, exp, sum, divide, value dot, their backward and the layout copies
between token- and head-major operands); the kernel reads q, k, v in their (B, T, H, D) layout and
keeps each (batch, head)'s scores in cache. Residuals are out and the logsumexp, O(T) per head, as
in ``blocked``. Float32 only; forward and gradients agree with torch's SDPA to about 1e-6 (tested
at 1e-5: parity_tests/test_attention_ffi.py).

Under a mesh, each call runs on its device's rows: ``custom_partitioning`` splits the batch axis
as the operands are split and replicates the rest (heads, length, features).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.nn.kernels import native

FWD, BWD = "jaxgpt_causal_attention_fwd", "jaxgpt_causal_attention_bwd"


available = native.kernels("causal_attention.cc", {FWD: "JaxgptCausalAttentionFwd", BWD: "JaxgptCausalAttentionBwd"},
                           "attention_impl='auto' runs the XLA kernels")


# static: (scale, segments, window). segments False: seg is ignored (all zeros) and the kernel's compare
# compiled out; window 0: no sliding window (its compare compiled out too)
def _fwd_call(q, k, v, seg, static):
    b, t, h, _ = q.shape
    call = jax.ffi.ffi_call(FWD, (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)))
    return call(q, k, v, seg, scale=np.float32(static[0]), segments=static[1], window=np.int64(static[2]))


def _bwd_call(q, k, v, seg, out, lse, dout, static):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return jax.ffi.ffi_call(BWD, shapes)(q, k, v, seg, out, lse, dout, scale=np.float32(static[0]), segments=static[1],
                                         window=np.int64(static[2]))


def _batch_axis(arg_shapes):
    """The mesh axes q's batch dim is split over (None: not split)."""
    spec = getattr(arg_shapes[0].sharding, "spec", None)
    return spec[0] if spec else None


def _per_batch_shard(fn, rule: str, n_out: int):
    """``fn(*arrays, static)`` as a custom_partitioning op that runs on each device's batch rows:
    every operand and result split along dim 0 as q is, the other dims replicated."""
    op = custom_partitioning(fn, static_argnums=(fn.__code__.co_argcount - 1,))

    def infer(static, mesh, arg_shapes, result_shape):
        return (NamedSharding(mesh, P(_batch_axis(arg_shapes))),) * n_out

    def partition(static, mesh, arg_shapes, result_shape):
        sh = NamedSharding(mesh, P(_batch_axis(arg_shapes)))
        return mesh, lambda *xs: fn(*xs, static), (sh,) * n_out, (sh,) * len(arg_shapes)

    op.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=rule)
    return op


_fwd = _per_batch_shard(_fwd_call, "b t h d, b s k d, b s k e, b t -> b t h d, b h t", 2)
_bwd = _per_batch_shard(_bwd_call, "b t h d, b s k d, b s k e, b t, b t h e, b h t, b t h e -> b t h d, b s k d, b s k e",
                        3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, seg, static):
    return _fwd(q, k, v, seg, static)[0]


def _attention_fwd(q, k, v, seg, static):
    out, lse = _fwd(q, k, v, seg, static)
    return out, (q, k, v, seg, out, lse)


def _attention_bwd(static, res, dout):
    return (*_bwd(*res, dout, static), None)  # segment ids: integers, no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q, k, v, *, scale: float | None = None, segment_ids=None, window: int | None = None):
    """Causal self-attention of q (B, T, H, D) over k, v (B, T, H_kv, D), float32, T the same for
    all three (no cache offset, no mask): out (B, T, H, D). Differentiable. ``segment_ids`` (B, T)
    int: packed documents, each query over its own segment's keys only (None: one segment).
    ``window``: a sliding window, a static int >= 1 (query i over keys i - window < j <= i)."""
    if not available():
        raise RuntimeError("the CPU causal-attention kernel is unavailable here (see the warning above)")
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"the C++ causal kernel takes a static sliding window >= 1, got {window!r}")
    static = (float(q.shape[-1] ** -0.5 if scale is None else scale), segment_ids is not None, window or 0)
    return _attention(q, k, v, seg, static)


__all__ = ["available", "causal_attention"]
