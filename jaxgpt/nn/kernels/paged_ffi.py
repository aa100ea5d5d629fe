"""The CPU kernels of cpu/paged_attention.cc as XLA FFI custom calls: PagedAttention over the
engine's page pools, and the same loop over generate()'s contiguous KV cache (cached_attention).

Why native code: in pure JAX (kernels/paged.py) a paged step gathers every row's pages into a
padded copy and reads it again; the kernel reads the pages in place, up to each query's own
position, in about a quarter of the time (docs/performance.md). Same float32 arithmetic: outputs
agree to 1e-6.

The source is compiled on first use (a few seconds, once; kernels/native.py). ``available()`` is
False, with one warning saying why, where that cannot be done (no compiler, another backend): the
engine then gathers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.nn.kernels import native, xla
from jaxgpt.nn.kernels.masks import NO_WINDOW

TARGET = "jaxgpt_paged_attention"
CACHED_TARGET = "jaxgpt_cached_attention"


available = native.kernels("paged_attention.cc",
                           {TARGET: "JaxgptPagedAttention", CACHED_TARGET: "JaxgptCachedAttention"},
                           "paged attention gathers its pages and decode attention reads every cache slot")


def _window(window):
    """The kernels' window operand: an int32 scalar, NO_WINDOW for None (may be traced)."""
    return jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)


def paged_attention(q, k_pool, v_pool, page_table, q_pos, *, scale: float | None = None, window=None):
    """q (B, T, H, D) float32 at positions q_pos (B, T) (-1: padding, zeros out) over float32 pools
    (num_pages, H_kv, page_size, D) through page_table (B, P): causal attention, out (B, T, H, D).
    A sliding ``window`` W: keys q_pos - W < j <= q_pos only (the pages before it are never read)."""
    if not available():
        raise RuntimeError("the CPU PagedAttention kernel is unavailable here (see the warning above)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pool, v_pool, page_table, q_pos, _window(window), scale=np.float32(scale))


def cached_attention(q, k, v, q_offset, *, scale: float | None = None, window=None):
    """Causal attention of q (B, T, H, D) float32, at positions q_offset + arange(T) (q_offset may
    be traced: a cache index), over a contiguous KV cache k, v float32 in layout 'rows'
    (B * H_kv, S, D) or 'heads' (B, H_kv, S, D), read in place and only up to each query's own
    position: a decode step no longer reads (and masks) the empty slots past the cache index
    (kernels.attend runs it for 'auto'). A query past the last slot sees all S keys, as under
    kernels/xla.py's causal mask. A sliding ``window`` W: keys q_pos - W < j <= q_pos only.
    Differentiable: the backward pass is kernels/xla.py's."""
    if not available():
        raise RuntimeError("the CPU cached-attention kernel is unavailable here (see the warning above)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _cached(q, k, v, jnp.asarray(q_offset, jnp.int32), _window(window), float(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _cached(q, k, v, q_offset, window, scale):
    q_pos = jnp.broadcast_to(q_offset + jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])  # (B, T)
    call = jax.ffi.ffi_call(CACHED_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k, v, q_pos, window, scale=np.float32(scale))


def _cached_fwd(q, k, v, q_offset, window, scale):
    return _cached(q, k, v, q_offset, window, scale), (q, k, v, q_offset, window)


def _cached_bwd(scale, res, dout):
    # Rare (a gradient through a cached forward): the einsum path's VJP with the same causal offset and window.
    q, k, v, q_offset, window = res
    layout = "rows" if k.ndim == 3 else "heads"
    _, vjp = jax.vjp(lambda q, k, v: xla.scaled_dot_product_attention(q, k, v, is_causal=True, q_offset=q_offset,
                                                                      scale=scale, kv_layout=layout, window=window),
                     q, k, v)
    zero = np.zeros((), jax.dtypes.float0)
    return (*vjp(dout), zero, zero)


_cached.defvjp(_cached_fwd, _cached_bwd)
