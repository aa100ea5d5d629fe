"""JAX's Pallas TPU paged attention (``jax.experimental.pallas.ops.tpu.paged_attention``) reading
the engine's page pools in place, for kv_layout 'pages' in a program lowered for a TPU
(kernels.attend, policy.on_tpu).

Where it runs: decode steps (one query token a row) over bfloat16 pools of head_dim a multiple of
128, without a sliding window (paged_dispatch.py). Mixed prefill + decode steps, and the pools and
windows it refuses, run our ragged kernel (tpu_ragged.py), which reads each page once per block of
queries where this one rereads it per query.

Why not JAX's ``ragged_paged_attention`` (the kernel built for mixed steps): on JAX 0.10 it lowers
for a TPU from a CPU host only when traced inside an abstract mesh naming a TPU device (its lowering
asks for the TPU generation; test_lowering.py), but it fails in TPU interpret mode
(``ReshapeTransform``), so nothing on a CPU host can prove its numbers (the canary in
test_tpu_kernels.py fails when it interprets); and it reads one pool of (pages, page_size, 2 H_kv, D)
with K and V interleaved by head, where the engine keeps (pages, H_kv, page_size, D) pools for K and V
apart (docs/performance.md).

How the decode kernel reads the engine's pools in place (it can serve a mixed step too, as below):
- Pools: it wants (H_kv, pages, page_size, D). The engine's (pages, H_kv, page_size, D) pool is,
  without a copy, one K/V head of pages * H_kv pages, page p of head h being p * H_kv + h.
- Queries: each (query, K/V head) pair is one "sequence" of the kernel: that head's G query heads
  (padded to a multiple of 8, the kernel's grouping), the row's page table offset to that head, and
  length q_pos + 1. So a prefill query sees keys up to its own position: the engine's "written and
  causal" mask, the same one paged.gather builds; padding (q_pos -1) has length 0 and returns zeros.
- Precision: the kernel reads K and V as bfloat16, so it takes bfloat16 pools only (other pools run
  the ragged kernel); queries and the softmax stay float32.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxgpt.nn.kernels import policy

__all__ = ["paged_attention", "unsupported"]

_GROUP = 8  # the kernel's query heads per K/V head: a multiple of 8 (fewer trip its block shapes)
_PAGES_PER_BLOCK = (8, 4, 2, 1)  # the largest that divides the page table's width


def unsupported(q, k_pool) -> str | None:
    """Why the TPU paged kernel cannot read these pools (None: it can). q (B, T, H, D); k_pool (pages, H_kv, page_size, D)."""
    if k_pool.dtype != jnp.bfloat16:
        return f"it reads K and V as bfloat16: a bfloat16 pool only (got {k_pool.dtype})"
    d = q.shape[-1]
    if d % 128:
        return f"head_dim must be a multiple of 128 (got {d})"
    if q.shape[2] % k_pool.shape[1]:
        return f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k_pool.shape[1]})"
    return policy.pallas_unsupported()


def paged_attention(q, k_pool, v_pool, page_table, q_pos, *, scale=None):
    """Attention of q (B, T, H, D) over the pools' pages: row b's query t sees the keys at positions
    0..q_pos[b, t] through page_table (B, P); q_pos -1 (padding) gives zeros. Returns (B, T, H, D) in q's dtype.
    The caller checks ``unsupported`` first."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel  # Pallas: where used

    b, t, h, d = q.shape
    n, h_kv, ps, _ = k_pool.shape
    g = h // h_kv
    gp = -(-g // _GROUP) * _GROUP
    scale = d ** -0.5 if scale is None else scale
    qs = (q.astype(jnp.float32) * scale).reshape(b * t * h_kv, g, d)  # sequence (b, t, kv head)
    qs = jnp.pad(qs, ((0, 0), (0, gp - g), (0, 0)))  # (B T H_kv, Gp, D): padded heads attend and are dropped
    heads = jnp.arange(h_kv, dtype=jnp.int32)
    table = page_table[:, None, None, :] * h_kv + heads[None, None, :, None]  # (B, 1, H_kv, P): page of each head
    table = jnp.broadcast_to(table, (b, t, h_kv, page_table.shape[1])).reshape(b * t * h_kv, -1)
    lengths = jnp.repeat(jnp.maximum(q_pos + 1, 0).reshape(-1), h_kv).astype(jnp.int32)  # (B T H_kv,)
    per_block = next(p for p in _PAGES_PER_BLOCK if page_table.shape[1] % p == 0)
    pools = [pool.reshape(1, n * h_kv, ps, d) for pool in (k_pool, v_pool)]  # a view: no copy
    call = functools.partial(kernel, pages_per_compute_block=per_block)
    out = policy.replicated(call, qs, *pools, lengths, table)  # (B T H_kv, Gp, D); under a mesh: per device
    out = out[:, :g].reshape(b, t, h, d)
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0.0).astype(q.dtype)
