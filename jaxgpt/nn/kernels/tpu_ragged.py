"""Ragged paged attention for TPU: our Pallas TPU kernel for the engine's mixed prefill and decode
steps, reading the page pools (num_pages, H_kv, page_size, D) in place (kernels/paged.py).

One grid step is (row, K/V head, query block, page); the page axis is last and sequential. The
page table, each query block's first and last visible page and the window are prefetched to SMEM,
so the K/V BlockSpecs' index maps look the page up (``table[row, page]``) and the pipeline DMAs that
page of that head straight from the pools. An online softmax (m, l, acc in VMEM scratch) runs over the
pages; pages outside the block's span (past its last query position, or before its sliding window)
are neither computed nor fetched (their index clamps to a page already in VMEM). A query block is
block_m rows of (token, query head) for one K/V head's G query heads (GQA), so each page a prefill
chunk needs is read once per block, not once per query as with the decode kernel (tpu_paged.py).

Mask as ``paged.gather``: key position <= query position ("written and causal"), and > position -
window where a sliding window is given; q_pos -1 (padding) gives zeros. float32, bfloat16 and int8
pools (int8 with their float32 per-token scales, dequantised to the queries' dtype, as gather does).
Proven in TPU interpret mode on the CPU (test_tpu_kernels.py); never run on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxgpt.nn.kernels import policy
from jaxgpt.nn.kernels.masks import NO_WINDOW
from jaxgpt.nn.kernels.paged import require_scales

__all__ = ["paged_attention", "unsupported"]

POOL_DTYPES = ("float32", "bfloat16", "int8")
Q_DTYPES = ("float32", "bfloat16")
MAX_BLOCK_M = 128  # (token, query head) rows per query block
SUBLANES = 16  # block rows a multiple of this: the second-minor tile of float32 (8) and bfloat16 (16)


def unsupported(q, k_pool) -> str | None:
    """Why the kernel cannot read these pools (None: it can). q (B, T, H, D); k_pool (pages, H_kv, page_size, D)."""
    if jnp.dtype(k_pool.dtype).name not in POOL_DTYPES:
        return f"it reads {', '.join(POOL_DTYPES)} pools (got {jnp.dtype(k_pool.dtype).name})"
    if jnp.dtype(q.dtype).name not in Q_DTYPES:
        return f"it computes in {' or '.join(Q_DTYPES)} (got {jnp.dtype(q.dtype).name} queries)"
    if q.shape[2] % k_pool.shape[1]:
        return f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k_pool.shape[1]})"
    return policy.pallas_unsupported()


def _kernel(table_ref, lo_ref, hi_ref, window_ref, pos_ref, q_ref, k_ref, v_ref, *rest, scale, pages, blocks):
    """Grid step (r, kv, qb, p): q_ref (block_m, D), pos_ref (block_m, 1) positions (-1: padding),
    k_ref / v_ref (page_size, D) page table[r, p] of head kv; int8: ks_ref / vs_ref (page_size, 1)."""
    ks_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = rest if len(rest) == 6 else (None, None, *rest)
    r, qb, p = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    span = r * blocks + qb
    ps = k_ref.shape[0]
    q = q_ref[...]

    @pl.when(p == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def load(ref, scale_ref):  # (page_size, D) in the queries' dtype
        if scale_ref is None:
            return ref[...].astype(q.dtype)
        return (ref[...].astype(jnp.float32) * scale_ref[...]).astype(q.dtype)

    def dot(a, b, dims):  # float32 products at full precision (a TPU's default f32 dot is bf16 passes)
        exact = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jax.lax.dot_general(a, b, (dims, ((), ())), precision=exact, preferred_element_type=jnp.float32)

    @pl.when((p >= lo_ref[span]) & (p <= hi_ref[span]))
    def _step():
        k, v = load(k_ref, ks_ref), load(v_ref, vs_ref)
        s = dot(q, k, ((1,), (1,))) * scale  # (block_m, page_size)
        key, pos = p * ps + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1), pos_ref[...]
        seen = (key <= pos) & (key > pos - window_ref[0])  # written and causal, inside the window
        s = jnp.where(seen, s, -jnp.inf)
        m_prev = m_ref[...]  # (block_m, 1)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that sees no key yet
        e = jnp.exp(s - m_safe)
        corr = jnp.exp(m_prev - m_safe)
        l_ref[...] = l_ref[...] * corr + jnp.sum(e, axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] * corr + dot(e.astype(v.dtype), v, ((1,), (0,)))  # (block_m, D)
        m_ref[...] = m_new

    @pl.when(p == pages - 1)
    def _finish():  # a padding row (position -1) saw no key: l 0, acc 0, out 0
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_m"))
def paged_attention(q, k_pool, v_pool, page_table, q_pos, k_scale=None, v_scale=None, *, scale=None, window=None,
                    block_m=None):
    """q (B, T, H, D) at positions q_pos (B, T) (-1: padding, zeros out) over pools (num_pages, H_kv,
    page_size, D) through page_table (B, P): causal by position (and within ``window``), out (B, T, H, D)
    in q's dtype. int8 pools take their scales k_scale, v_scale (num_pages, H_kv, page_size). ``window``:
    an int or a traced int32 scalar (a scanned layer's; None or masks.NO_WINDOW: none). ``block_m``:
    (token, query head) rows a query block, a multiple of 16 (default: T * G rounded up to 16, at most
    MAX_BLOCK_M)."""
    why = unsupported(q, k_pool)
    if why is not None:
        raise ValueError(f"the Pallas TPU ragged paged-attention kernel cannot run this call: {why}")
    require_scales(k_pool, k_scale)
    b, t, h, d = q.shape
    n, h_kv, ps, _ = k_pool.shape
    g, pages = h // h_kv, page_table.shape[1]
    scale = d ** -0.5 if scale is None else scale
    rows = t * g  # row t * G + j of a K/V head is token t, query head kv * G + j
    block_m = block_m or min(-(-rows // SUBLANES) * SUBLANES, MAX_BLOCK_M)
    if block_m % SUBLANES:
        raise ValueError(f"block_m must be a multiple of {SUBLANES} (got {block_m})")
    blocks = -(-rows // block_m)
    m = blocks * block_m
    qr = q.reshape(b, t, h_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, h_kv, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m - rows), (0, 0)))  # (B, H_kv, M, D)
    pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1), ((0, 0), (0, m - rows)), constant_values=-1)
    last = jnp.max(pos.reshape(b, blocks, block_m), axis=2)  # (B, blocks): -1 for a block of padding
    first = jnp.min(jnp.where(pos < 0, last.max() + 1, pos).reshape(b, blocks, block_m), axis=2)
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)
    lo = jnp.maximum(first - window + 1, 0) // ps
    hi = jnp.where(last < 0, -1, jnp.minimum(last // ps, pages - 1))  # the block's visible pages: lo..hi
    flat = page_table.astype(jnp.int32).reshape(-1)  # 1-D in SMEM (a 2-D array pads to (8, 128) tiles)

    def page(r, kv, qb, p, table, lo, hi, _):  # the pool page step p reads: outside lo..hi, one already fetched
        i = r * blocks + qb
        return table[r * pages + jnp.minimum(jnp.maximum(p, lo[i]), jnp.maximum(hi[i], lo[i]))]

    pool_spec = pl.BlockSpec((None, None, ps, d), lambda r, kv, qb, p, *s: (page(r, kv, qb, p, *s), kv, 0, 0))
    scale_spec = pl.BlockSpec((None, None, ps, 1), lambda r, kv, qb, p, *s: (page(r, kv, qb, p, *s), kv, 0, 0))
    row_spec = pl.BlockSpec((None, None, block_m, d), lambda r, kv, qb, p, *_: (r, kv, qb, 0))
    scales = () if k_scale is None else (k_scale[..., None], v_scale[..., None])  # (pages, H_kv, page_size, 1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(b, h_kv, blocks, pages),
        in_specs=[pl.BlockSpec((None, block_m, 1), lambda r, kv, qb, p, *_: (r, qb, 0)), row_spec, pool_spec,
                  pool_spec, *(scale_spec for _ in scales)],
        out_specs=row_spec,
        scratch_shapes=[pltpu.VMEM((block_m, 1), jnp.float32), pltpu.VMEM((block_m, 1), jnp.float32),
                        pltpu.VMEM((block_m, d), jnp.float32)])
    call = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), pages=pages, blocks=blocks),
        grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype), name="jaxgpt_tpu_ragged_paged_attention",
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")))
    operands = (flat, lo.reshape(-1), hi.reshape(-1), window[None], pos[:, :, None], qr, k_pool, v_pool, *scales)
    out = policy.replicated(call, *operands)  # (B, H_kv, M, D); under a mesh: per device
    return out[:, :, :rows].reshape(b, h_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
