"""PagedAttention for CUDA: a Pallas (Triton) kernel that reads the engine's page pools in place.

Off the CPU the engine used to gather every row's pages into a padded copy each step
(kernels/paged.py ``gather``) and attend over the copy. This kernel follows the page table instead:
one program per (row, KV head, block of queries) loads its row's pages a block at a time straight
from the pools (num_pages, H_kv, page_size, D), the layout the engine and the C++ CPU kernel use,
and runs an online softmax over them, causal by each query's position, stopping at the block's
last position. float32, bfloat16 (float16) and int8 pages (dequantised in the kernel with their
per-token scales, to the queries' dtype, as ``gather`` does).

The queries of one KV head (its G = H / H_kv query heads, times T tokens) are the rows of one
matrix, so a GQA decode step is a (G, D) x (D, keys) product per page block.

Why Pallas on Triton, and not Mosaic GPU (docs/performance.md, "Kernels by platform"): on this
JAX the Mosaic GPU lowering of the kernel's row reductions is unimplemented ("No support for axes
yet") and its interpret mode failed on a page copy, so it could be neither lowered for CUDA nor
run on a CPU host; the Triton kernel lowers for 'cuda' from a CPU host (custom call
``__gpu$xla.gpu.triton``) and runs here in Pallas' interpret mode (``interpret=True``).

Triton needs power-of-two block sizes: ``unsupported`` says why a call cannot run (head_dim or
page_size not a power of two, an unsupported dtype), and the policy gathers instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxgpt.nn.kernels.paged import require_scales

__all__ = ["paged_attention", "unsupported"]

DTYPES = ("float32", "bfloat16", "float16", "int8")
MIN_DOT = 16  # Triton's tl.dot takes operands of at least 16 x 16; smaller ones multiply and sum
MAX_BLOCK_Q = 64  # query rows per program
BLOCK_K = 64  # keys per step of the online softmax (whole pages: at least one)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported(q, k_pool) -> str | None:
    """Why the kernel cannot run attention of q (B, T, H, D) over pools (num_pages, H_kv, page_size, D)
    (None: it can)."""
    n, h_kv, ps, d = k_pool.shape
    if jnp.dtype(k_pool.dtype).name not in DTYPES:
        return f"it reads {', '.join(DTYPES)} pages (got {jnp.dtype(k_pool.dtype).name})"
    if jnp.dtype(q.dtype).name not in DTYPES[:3]:
        return f"it computes in float32, bfloat16 or float16 (got {jnp.dtype(q.dtype).name} queries)"
    if not (_pow2(d) and _pow2(ps)):
        return f"Triton blocks are powers of two: head_dim {d} and page_size {ps} must be"
    if q.shape[2] % h_kv:
        return f"{q.shape[2]} query heads are not a multiple of {h_kv} KV heads"
    return None


def _dot(a, b):
    """a (M, D) @ b (N, D).T in float32: tl.dot where Triton takes it, else a broadcast product."""
    if min(*a.shape, b.shape[0]) >= MIN_DOT:
        return pltriton.dot(a, b, trans_b=True, precision=jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=-1)


def _pv(p, v):
    """p (M, N) @ v (N, D) in float32."""
    if min(*p.shape, v.shape[1]) >= MIN_DOT:
        return pltriton.dot(p, v, precision=jax.lax.Precision.HIGHEST if p.dtype == jnp.float32 else None)
    return jnp.sum(p.astype(jnp.float32)[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)


def _kernel(table_ref, pos_ref, q_ref, k_ref, v_ref, *rest, scale, pages_per_block, quantized):
    """One (row, KV head, query block): q_ref (block_q, D), pos_ref (block_q,) positions (-1: padding),
    table_ref (P,) the row's pages, k_ref / v_ref (num_pages, page_size, D) the head's pools."""
    ks_ref, vs_ref, o_ref = rest if quantized else (None, None, rest[0])
    block_q, d = q_ref.shape
    ps = k_ref.shape[1]
    block_k = pages_per_block * ps
    q = q_ref[...]
    pos = pos_ref[...]

    def load(ref, scale_ref, pages):  # (pages_per_block,) page ids -> (block_k, D) in the queries' dtype
        x = ref[pages].reshape(block_k, d)
        if scale_ref is None:
            return x
        s = scale_ref[pages].reshape(block_k)
        return (x.astype(jnp.float32) * s[:, None]).astype(q.dtype)

    def body(j, carry):
        o, m, l = carry  # (block_q, D), (block_q,), (block_q,) float32
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)]
        k, v = load(k_ref, ks_ref, pages), load(v_ref, vs_ref, pages)
        s = _dot(q, k) * scale  # (block_q, block_k)
        key_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        s = jnp.where(key_pos <= pos[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that sees no key yet
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m - m_safe)
        o = o * corr[:, None] + _pv(p.astype(v.dtype), v)
        return o, m_new, l * corr + jnp.sum(p, axis=1)

    blocks = table_ref.shape[0] // pages_per_block
    n = jnp.minimum((jnp.max(pos) + block_k) // block_k, blocks)  # up to the block's last position
    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    o, _, l = jax.lax.fori_loop(0, n, body, init)
    o_ref[...] = jnp.where((pos >= 0)[:, None], o / jnp.where(l == 0, 1.0, l)[:, None], 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_attention(q, k_pool, v_pool, page_table, q_pos, k_scale=None, v_scale=None, *, scale: float | None = None,
                    interpret: bool = False):
    """q (B, T, H, D) at positions q_pos (B, T) (-1: padding, zeros out) over pools (num_pages, H_kv,
    page_size, D) through page_table (B, P): causal attention by position, out (B, T, H, D) in q's
    dtype. int8 pools take their float32 scales k_scale, v_scale (num_pages, H_kv, page_size).
    ``interpret``: run the kernel in Pallas' interpret mode (any backend; how the CPU tests run it)."""
    why = unsupported(q, k_pool)
    if why is not None:
        raise ValueError(f"the Pallas paged-attention kernel cannot run this call: {why}")
    require_scales(k_pool, k_scale)
    b, t, h, d = q.shape
    n, h_kv, ps, _ = k_pool.shape
    g = h // h_kv
    scale = d ** -0.5 if scale is None else scale
    rows = t * g  # the queries of one KV head: row t * G + g is token t, query head kv * G + g
    block_q = min(max(1 << (rows - 1).bit_length(), MIN_DOT), MAX_BLOCK_Q)
    m = -(-rows // block_q) * block_q
    qr = q.reshape(b, t, h_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, h_kv, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m - rows), (0, 0)))  # (B, H_kv, M, D)
    pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1), ((0, 0), (0, m - rows)), constant_values=-1)
    ppb = max(BLOCK_K // ps, 1)
    p = page_table.shape[1]
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, -p % ppb)))  # whole blocks; padding: scratch page 0
    pool_spec = pl.BlockSpec((n, None, ps, d), lambda i, kv, j: (0, kv, 0, 0))
    scale_spec = pl.BlockSpec((n, None, ps), lambda i, kv, j: (0, kv, 0))
    quantized = k_scale is not None
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), pages_per_block=ppb, quantized=quantized),
        grid=(b, h_kv, m // block_q),
        in_specs=[pl.BlockSpec((None, table.shape[1]), lambda i, kv, j: (i, 0)),
                  pl.BlockSpec((None, block_q), lambda i, kv, j: (i, j)),
                  pl.BlockSpec((None, None, block_q, d), lambda i, kv, j: (i, kv, j, 0)),
                  pool_spec, pool_spec, *((scale_spec, scale_spec) if quantized else ())],
        out_specs=pl.BlockSpec((None, None, block_q, d), lambda i, kv, j: (i, kv, j, 0)),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic GPU
        name="jaxgpt_gpu_paged_attention",
    )(table, pos, qr, k_pool, v_pool, *((k_scale, v_scale) if quantized else ()))
    return out[:, :, :rows].reshape(b, h_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)

