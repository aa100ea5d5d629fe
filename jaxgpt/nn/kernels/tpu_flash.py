"""JAX's Pallas TPU flash attention (``jax.experimental.pallas.ops.tpu.flash_attention``) under
jaxgpt's attention contract, for the calls 'auto' sends to it in a program lowered for a TPU
(kernels.attend, policy.on_tpu): train steps and prefill, self-attention over the call's own keys.

Why flash attention and not splash attention: flash takes the batch, a traced (B, T) pair of
segment ids and a static causal flag directly, with a backward pass of its own; splash needs a
static (numpy) mask object per shape and a vmap over the batch, for the same two masks jaxgpt
needs. Flash has no grouped key/value heads: K and V heads are broadcast to the query heads
(``jnp.repeat``, head = kv_head * G + group, as the 'xla' kernel groups them); the repeat's
gradient sums each group back. Splash's MQA form would avoid the copy; measured on no TPU.

``unsupported`` is the one rule for which calls the kernel takes; every other call runs the
portable kernel 'auto' picks ('blocked' or 'xla'). On the CPU the kernel runs only in TPU
interpret mode (``pltpu.force_tpu_interpret_mode``), which is how the tests check its numbers.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgpt.config.mesh import BATCH_AXES
from jaxgpt.nn.kernels import policy

__all__ = ["BLOCK", "flash_attention", "unsupported"]

BLOCK = 128  # the kernel's key block must be a multiple of 128 lanes; its query block matches
_BLOCKS = (512, 256, BLOCK)  # the largest that divides T: fewer grid steps (none measured on a TPU)


def unsupported(q, k, *, mask, is_causal, q_offset, kv_layout, scale=None, dropout_rate=0.0,
                return_weights=False) -> str | None:
    """Why the TPU flash kernel cannot run this call (None: it can). q (B, Tq, H, D); k (B, Tk, H_kv, D)."""
    if return_weights or dropout_rate > 0.0:
        return "it returns no weights and has no attention dropout"
    if mask is not None:
        return "it takes no mask (segment ids and the causal flag only)"
    tq, h, d = q.shape[1], q.shape[2], q.shape[3]
    if kv_layout != "tokens" or k.shape[1] != tq or (is_causal and not (isinstance(q_offset, int) and q_offset == 0)):
        return "it computes self-attention over the call's own keys (no KV cache)"
    if tq % BLOCK:
        return f"its blocks are {BLOCK} tokens: T must be a multiple of {BLOCK} (got {tq})"
    if d > 128 and d % 128:
        return f"head_dim must be at most 128 or a multiple of 128 (got {d})"
    if h % k.shape[2]:
        return f"query heads ({h}) must be a multiple of key/value heads ({k.shape[2]})"
    if scale is not None and not isinstance(scale, (int, float)):
        return "its scale is a static number (got a traced one)"
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        return f"it computes in float32 or bfloat16 (got {q.dtype})"
    return policy.pallas_unsupported()


def flash_attention(q, k, v, *, is_causal=False, scale=None, segment_ids=None):
    """softmax(q k^T * scale) v by the Pallas TPU kernel. q (B, T, H, D); k, v (B, T, H_kv, D);
    ``segment_ids`` (B, T) int: a query sees only keys of its own id. Returns (B, T, H, D).
    The caller checks ``unsupported`` first. Under a mesh (policy.pallas_mesh) the kernel runs in a
    shard_map: each device on its rows (split over the batch axes where they divide B) and its heads
    (over 'tensor' where it divides H_kv), the rest replicated."""
    kw = dict(is_causal=is_causal, scale=scale)
    found = policy.pallas_mesh()
    if found is None:
        return _flash(q, k, v, segment_ids, **kw)
    mesh, free = found
    batch = tuple(a for a in BATCH_AXES if a in free)
    rows = batch if batch and q.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else None
    heads = "tensor" if "tensor" in free and mesh.shape["tensor"] > 1 and k.shape[2] % mesh.shape["tensor"] == 0 \
        else None
    x, s = P(rows, None, heads, None), P(rows, None)  # (B, T, H, D), (B, T)
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: _flash(q, k, v, None, **kw), mesh=mesh, in_specs=(x,) * 3,
                             out_specs=x, axis_names=set(free), check_vma=False)(q, k, v)
    return jax.shard_map(lambda q, k, v, seg: _flash(q, k, v, seg, **kw), mesh=mesh, in_specs=(x, x, x, s),
                         out_specs=x, axis_names=set(free), check_vma=False)(q, k, v, segment_ids)


def _flash(q, k, v, segment_ids, *, is_causal, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention as _fa  # Pallas: imported where used

    b, t, h, d = q.shape
    g = h // k.shape[2]
    heads = lambda x: x.transpose(0, 2, 1, 3)  # (B, T, H, D) <-> (B, H, T, D)
    kh, vh = heads(k), heads(v)  # (B, H_kv, T, D)
    if g > 1:  # no grouped heads in the kernel: each K/V head serves its G query heads
        kh, vh = jnp.repeat(kh, g, axis=1), jnp.repeat(vh, g, axis=1)
    blk = next(n for n in _BLOCKS if t % n == 0)
    blocks = _fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                            block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk,
                            block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)
    seg = None if segment_ids is None else _fa.SegmentIds(q=segment_ids.astype(jnp.int32),
                                                          kv=segment_ids.astype(jnp.int32))
    out = _fa.flash_attention(heads(q), kh, vh, segment_ids=seg, causal=bool(is_causal),
                              sm_scale=float(d ** -0.5 if scale is None else scale), block_sizes=blocks)
    return heads(out)
