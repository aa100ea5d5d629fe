"""The KV caches' one contract, and the contiguous cache.

A cache is what an Attention layer writes its keys and values into and attends over (``KVCacheLike``):

- ``offset``: the position this call's first token sits at (None: the caller passes positions);
- ``room(t)``: raise where t more tokens do not fit (checked mode for a traced index);
- ``write(k, v)``: the cache with k, v (B, T, H_kv, D) written;
- ``read(mask, is_causal, window)``: what ``kernels.attend`` attends over (a ``KVRead``).

Two implement it: ``KVCache`` here (contiguous slots, for ``generate`` and direct model calls) and
``kernels.paged.PagedKVCache`` (the serving engine's page pools).

KVCache.layout: how k and v are stored. S is the capacity; index is () except where noted.
  'heads'   (B, H_kv, S, D)                 one layer (KVCache.init); read as kv_layout 'heads'
  'rows'    (B * H_kv, S, D), row b*H_kv+h  one layer, the copy-free decode layout
                                            (init_cache(..., per_layer=True)); read as kv_layout 'rows'
  'stacked' (L, B, H_kv, S, D), index (L,)  every layer (init_cache); the decoder's layer loop hands
                                            each layer the whole buffer with `layer` and its own index
"""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.core import validate
from jaxgpt.nn import checks
from jaxgpt.nn.kernels.masks import keys_before
from jaxgpt.nn.kernels.xla import KVRead

CACHE_LAYOUTS = ("heads", "rows", "stacked")


class KVCacheLike(Protocol):
    """The contract every KV cache implements (module docstring)."""

    @property
    def offset(self): ...

    def room(self, t: int) -> None: ...

    def write(self, k, v) -> KVCacheLike: ...

    def read(self, mask=None, is_causal: bool = True, window=None) -> KVRead: ...


@struct.dataclass
class KVCache:
    """Preallocated keys/values and how many positions are already written. A pytree whose
    ``layout`` is static (part of the tree structure, so jit and while_loop keep it)."""

    k: jax.Array
    v: jax.Array
    index: jax.Array  # next write position == number of cached positions
    layout: str = struct.field(pytree_node=False, default="heads")  # CACHE_LAYOUTS
    # 'stacked' only: the layer this call owns. It writes only its new slots of k[layer] / v[layer]
    # in place, so a decode step never copies the whole cache.
    layer: jax.Array | int | None = None

    def __post_init__(self):
        if self.layout not in CACHE_LAYOUTS:
            raise ValueError(f"KVCache layout={self.layout!r} is not one of {CACHE_LAYOUTS}")

    @classmethod
    def init(cls, batch: int, n_kv_head: int, max_len: int, head_dim: int, dtype=jnp.float32,
             layout: str = "heads") -> "KVCache":
        """An empty one-layer cache in layout 'heads' or 'rows'."""
        if layout not in ("heads", "rows"):
            raise ValueError(f"KVCache.init makes one layer's cache: layout 'heads' or 'rows', got {layout!r} "
                             f"(init_cache makes the 'stacked' one)")
        shape = (batch, n_kv_head, max_len, head_dim) if layout == "heads" else (batch * n_kv_head, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32), layout)

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]  # S is the second-to-last axis in every layout

    @property
    def offset(self):
        """The number of cached positions (layer 0's of a 'stacked' cache)."""
        return self.index.reshape(-1)[0]

    def room(self, t: int) -> None:
        """Raise where t more positions overflow the capacity (a debug check for a traced index:
        dynamic_update_slice would clamp the start and overwrite the last slots)."""
        if checks.is_traced(self.index):
            checks.check_cache_room(self.offset, t, self.capacity)  # checked mode (checkify) only
        else:
            validate.check_cache_room(int(self.offset), t, self.capacity)

    def write(self, k, v) -> KVCache:
        """The cache with k, v (B, T, H_kv, D) written at slots [index, index + T)."""
        b, t, h_kv, d = k.shape
        self.room(t)
        want = {"heads": (b, h_kv, self.capacity, d), "rows": (b * h_kv, self.capacity, d),
                "stacked": self.k.shape[:1] + (b, h_kv, self.capacity, d)}[self.layout]
        if self.k.shape != want:
            raise ValueError(f"a {self.layout!r} KV cache of shape {tuple(self.k.shape)} does not fit batch {b} x "
                             f"{h_kv} key/value heads of size {d}: it needs {want}")
        if self.layout == "stacked" and self.layer is None:
            raise ValueError("a 'stacked' KV cache holds every layer: pass it to DecoderLM, which hands each "
                             "layer its part; a single Attention takes KVCache.init(...)")
        # (B, T, H_kv, D) -> (B, H_kv, T, D): only the new tokens are transposed.
        k_new = k.transpose(0, 2, 1, 3).astype(self.k.dtype)
        v_new = v.transpose(0, 2, 1, 3).astype(self.v.dtype)
        at = self.index
        if self.layout == "rows":
            k_new, v_new, start = k_new.reshape(b * h_kv, t, d), v_new.reshape(b * h_kv, t, d), (0, at, 0)
        elif self.layout == "heads":
            start = (0, 0, at, 0)
        else:
            k_new, v_new, start = k_new[None], v_new[None], (self.layer, 0, 0, at, 0)
        kc = jax.lax.dynamic_update_slice(self.k, k_new, start)
        vc = jax.lax.dynamic_update_slice(self.v, v_new, start)
        return self.replace(k=kc, v=vc, index=at + t)

    def read(self, mask=None, is_causal: bool = True, window=None) -> KVRead:
        """All S slots (those past the index are empty) and ``mask`` narrowed to the written slots where
        causality from the cache offset does not already hide the empty ones; the window passes on."""
        if mask is not None or not is_causal:
            written = keys_before(self.capacity, self.index)  # (S,)
            mask = written if mask is None else mask & written
        if self.layout != "stacked":
            return KVRead(self.k, self.v, self.layout, mask, is_causal, window)
        k = jax.lax.dynamic_index_in_dim(self.k, self.layer, 0, keepdims=False)  # (B, H_kv, S, D)
        v = jax.lax.dynamic_index_in_dim(self.v, self.layer, 0, keepdims=False)
        return KVRead(k, v, "heads", mask, is_causal, window)


__all__ = ["CACHE_LAYOUTS", "KVCache", "KVCacheLike", "KVRead"]
