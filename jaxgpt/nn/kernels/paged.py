"""Paged KV cache for one layer (PagedAttention, vLLM): keys and values live in a pool of pages,
each sequence owns pages found through its row of a page table, and attention gathers them so
they are logically contiguous. Pure JAX (scatter + gather), so it runs on the CPU.

Pool layout per layer: (num_pages, H_kv, page_size, D), so one gather by (row, head, page) lays
the keys out as kv_layout 'rows' (B * H_kv, S, D), the layout the decode kernel reads without a
transpose (read as 'tokens', a (num_pages, page_size, H_kv, D) pool is slower: docs/performance.md).
Page 0 is the scratch page: padding tokens write there and unused page-table entries point there; the mask hides it.

A batch is (B, T) ragged rows: row b's query t sits at absolute position q_pos[b, t] (-1 for
padding) and writes its key/value to flat slot ``slots[b, t]`` = page * page_size + offset.
Key j of the gathered row is the token at position j (page table entry j // page_size), so
"written and causal" is one mask: key position <= query position. The attention itself goes
through ``kernels.attend``, as every call does: layout 'rows' (the gathered pages) for the kernel
every other call uses, or, for every kernel but ``kernel='gather'``, layout 'pages': attend reads
the pools in place with the kernel the program's lowering platform gets (kernels/paged_dispatch.py:
the C++ kernel on the CPU, the Pallas kernel on CUDA), with the same results.

kv 'int8': the pools hold int8 with a float32 absmax scale per token and head (k_scale, v_scale
(num_pages, H_kv, page_size)); gathered pages are dequantised before attention.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.nn.kernels.xla import KVRead

# The engine's paged_kernel: 'gather' copies the pages (pure JAX); 'ffi' the C++ CPU kernel, 'pallas'
# the Pallas kernel (CUDA; interpreted on the CPU), both refused where they cannot lower; 'auto' each
# platform's in-place kernel where it takes the call, else the gather (kernels/paged_dispatch.py).
PAGED_KERNELS = ("auto", "gather", "ffi", "pallas")


class Pages(NamedTuple):
    """What attend needs to read a paged cache's pools in place (kv_layout 'pages')."""

    page_table: jax.Array  # (B, P) int32
    q_pos: jax.Array  # (B, T) int32, -1 for padding
    k_scale: jax.Array | None = None  # int8 pools only: (num_pages, H_kv, page_size) float32
    v_scale: jax.Array | None = None
    kernel: str = "auto"  # PAGED_KERNELS, as resolved by the engine


def quantize_int8(x):
    """x (..., D) -> (int8 (..., D), scale (...)) with absmax scaling per vector."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def dequantize_int8(q, scale, dtype):
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def require_scales(k_pool, k_scale):
    """The in-place kernels' contract: int8 pools come with their scales, other pools with none."""
    if (k_pool.dtype == jnp.int8) != (k_scale is not None):
        raise ValueError(f"int8 pools need their scales and other pools none (pools {k_pool.dtype}, "
                         f"scales {'given' if k_scale is not None else 'none'})")


@struct.dataclass
class PagedKVCache:
    """One layer's page pools plus the step's page table and write slots (shared by all layers)."""

    k: jax.Array  # (num_pages, H_kv, page_size, D), compute dtype or int8
    v: jax.Array
    page_table: jax.Array  # (B, P) int32 page ids; entry j holds positions [j * page_size, (j + 1) * page_size)
    slots: jax.Array  # (B, T) int32 flat write slots (page * page_size + offset); padding -> scratch page 0
    q_pos: jax.Array  # (B, T) int32 absolute position of each query, -1 for padding
    k_scale: jax.Array | None = None  # int8 only: (num_pages, H_kv, page_size) float32
    v_scale: jax.Array | None = None
    compute_dtype: str = struct.field(pytree_node=False, default="float32")
    layout: str = struct.field(pytree_node=False, default="paged")
    # 'gather': pure JAX, pages gathered then kernels.attend; the others read them in place
    # (PAGED_KERNELS, chosen by the engine; kernels/paged_dispatch.py)
    kernel: str = struct.field(pytree_node=False, default="gather")

    @property
    def offset(self):
        """None: a paged batch's rows start at their own positions, which the caller passes (q_pos)."""
        return None

    @property
    def pages(self) -> Pages:
        """The page table, positions, int8 scales and kernel attend reads the pools in place with."""
        return Pages(self.page_table, self.q_pos, self.k_scale, self.v_scale, self.kernel)

    @property
    def capacity(self) -> int:
        return self.page_table.shape[1] * self.k.shape[2]

    def room(self, t: int) -> None:
        """The engine's scheduler allots the pages before a step: here each of the t tokens needs its slot."""
        if self.slots.shape[-1] != t:
            raise ValueError(f"a paged KV cache with write slots for {self.slots.shape[-1]} tokens a row was "
                             f"given {t}")

    def write(self, k, v) -> PagedKVCache:
        """The cache with k, v (B, T, H_kv, D) in their slots (the pools are updated in place when the
        caller donates them). The KV caches' one contract: jaxgpt.nn.kv_cache."""
        self.room(k.shape[1])
        n, h_kv, ps, d = self.k.shape
        page = (self.slots // ps).reshape(-1)  # (B*T,)
        off = (self.slots % ps).reshape(-1)

        def put(pool, scale, x):
            x = x.reshape(-1, h_kv, d)  # (B*T, H_kv, D): advanced indices around a slice put the tokens first
            if scale is None:
                return pool.at[page, :, off].set(x.astype(pool.dtype)), None
            q, s = quantize_int8(x)
            return pool.at[page, :, off].set(q), scale.at[page, :, off].set(s)

        kp, ks = put(self.k, self.k_scale, k)
        vp, vs = put(self.v, self.v_scale, v)
        return self.replace(k=kp, v=vp, k_scale=ks, v_scale=vs)

    def read(self, mask=None, is_causal: bool = True, window=None):
        """What attend reads (a kv_cache.KVRead): the mask is built from the query positions ("written
        and causal"), so the call passes none. kernel 'gather': each row's pages, layout 'rows', with a
        sliding ``window`` folded into the mask; any other: the pools themselves, layout 'pages' (attend
        reads them in place through the page table and takes the window itself)."""
        if mask is not None:
            raise ValueError("a paged KV cache builds its own mask from the query positions; pass mask=None")
        if self.kernel != "gather":
            return KVRead(self.k, self.v, "pages", None, is_causal, window, self.pages)
        k, v, mask = self.gather(window)
        return KVRead(k, v, "rows", mask, False)

    def gather(self, window=None):
        """Each row's pages, logically contiguous: (keys, values in kv_layout 'rows', the mask); ``gather``."""
        return gather(self.k, self.v, self.page_table, self.q_pos, self.k_scale, self.v_scale, self.compute_dtype,
                      window=window)


def gather(k_pool, v_pool, page_table, q_pos, k_scale=None, v_scale=None, dtype="float32", *, window=None):
    """Each row's pages, logically contiguous: keys, values in kv_layout 'rows' (B * H_kv, P * page_size, D)
    and the mask (B, 1, T, S), key position <= query position. One gather indexed by (row, head, page)
    builds the 'rows' layout the decode kernel reads in place: no transpose. int8 pages (with their
    scales) are dequantised to ``dtype``. A sliding ``window`` W also needs key position > query position - W."""
    n, h_kv, ps, d = k_pool.shape
    b, p = page_table.shape
    rows = page_table[:, None, :]  # (B, 1, P)
    heads = jnp.arange(h_kv)[None, :, None]  # (1, H_kv, 1)

    def one(pool, scale):  # pool[(b, h, p)] -> (B, H_kv, P, page_size, D) -> (B * H_kv, S, D)
        g = pool[rows, heads].reshape(b * h_kv, p * ps, d)
        if scale is None:
            return g
        return dequantize_int8(g, scale[rows, heads].reshape(b * h_kv, p * ps), dtype)

    key, query = jnp.arange(p * ps)[None, None, :], q_pos[:, :, None]
    mask = key <= query  # (B, T, S): written and causal
    if window is not None:
        mask = mask & (key > query - window)
    return one(k_pool, k_scale), one(v_pool, v_scale), mask[:, None]
