"""The multi-head Attention module (MHA / GQA / MQA, self- and cross-attention, RoPE) and its KV
cache. The attention itself is ``kernels.attend``, the one entry to every kernel.

Layout: activations stay (B, T, H, D) from the projections to the output, so no transposes are
needed around the attention core; GQA is an einsum over (kv_head, group) without repeating K/V.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxgpt.config.execution import DEFAULT_EXECUTION, Execution
from jaxgpt.config.rope import RopeScaling
from jaxgpt.core import validate
from jaxgpt.nn import checks
from jaxgpt.nn.kernels import attend, keys_before
from jaxgpt.nn.kernels import causal_mask, scaled_dot_product_attention  # noqa: F401  (public names)
from jaxgpt.nn.mlp import dense
from jaxgpt.nn.positions import layer_rope
from jaxgpt.nn.precision import module_scope
from jaxgpt.nn.qk_norm import qk_norm

# KVCache.layout: how k and v are stored. S is the capacity; index is () except where noted.
#   'heads'   (B, H_kv, S, D)                 one layer (KVCache.init); read as kv_layout 'heads'
#   'rows'    (B * H_kv, S, D), row b*H_kv+h  one layer, the copy-free decode layout
#                                             (init_cache(..., per_layer=True)); read as kv_layout 'rows'
#   'stacked' (L, B, H_kv, S, D), index (L,)  every layer (init_cache); the decoder's layer loop hands
#                                             each layer the whole buffer with `layer` and its own index
CACHE_LAYOUTS = ("heads", "rows", "stacked")


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

    def write(self, k, v, mask=None, is_causal=True, window=None):
        """Write keys and values k, v (B, T, H_kv, D) at slots [index, index + T).

        The KV caches' one contract (kernels.paged.PagedKVCache.write too): returns (the cache after
        the write, keys, values to attend over (all S slots; those past the new index are empty),
        their kv_layout for ``kernels.attend``, the call's ``mask`` (broadcastable to (B, H, T, S))
        narrowed to the written slots where causality does not already hide the empty ones, is_causal).
        ``window``: the layer's sliding window, which a cache that answers is_causal=False folds into
        its mask (a paged cache's 'gather'); here causality by the cache offset carries it to attend.
        """
        t = k.shape[1]
        if mask is not None or not is_causal:  # causal from the cache offset already hides the empty slots
            written = keys_before(self.capacity, self.index + t)  # (S,): slots past the write index are empty
            mask = written if mask is None else mask & written
        cache, k, v, kv_layout = self._write(k, v)
        return cache, k, v, kv_layout, mask, is_causal

    def _write(self, k, v):
        b, t, h_kv, d = k.shape
        if checks.is_traced(self.index):  # dynamic_update_slice would clamp the start and overwrite the last slots
            checks.check_cache_room(self.index, t, self.capacity)  # checked mode (checkify) only
        else:
            validate.check_cache_room(int(self.index), t, self.capacity)
        want = {"heads": (b, h_kv, self.capacity, d), "rows": (b * h_kv, self.capacity, d),
                "stacked": self.k.shape[:1] + (b, h_kv, self.capacity, d)}[self.layout]
        if self.k.shape != want:
            raise ValueError(f"a {self.layout!r} KV cache of shape {tuple(self.k.shape)} does not fit batch {b} x "
                             f"{h_kv} key/value heads of size {d}: it needs {want}")
        # (B, T, H_kv, D) -> (B, H_kv, T, D): only the new tokens are transposed.
        k_new = k.transpose(0, 2, 1, 3).astype(self.k.dtype)
        v_new = v.transpose(0, 2, 1, 3).astype(self.v.dtype)
        at = self.index
        if self.layout == "rows":
            kc = jax.lax.dynamic_update_slice(self.k, k_new.reshape(b * h_kv, t, d), (0, at, 0))
            vc = jax.lax.dynamic_update_slice(self.v, v_new.reshape(b * h_kv, t, d), (0, at, 0))
            return KVCache(kc, vc, at + t, "rows"), kc, vc, "rows"
        if self.layout == "heads":
            kc = jax.lax.dynamic_update_slice(self.k, k_new, (0, 0, at, 0))
            vc = jax.lax.dynamic_update_slice(self.v, v_new, (0, 0, at, 0))
            return KVCache(kc, vc, at + t, "heads"), kc, vc, "heads"
        if self.layer is None:
            raise ValueError("a 'stacked' KV cache holds every layer: pass it to DecoderLM, which hands each "
                             "layer its part; a single Attention takes KVCache.init(...)")
        kc = jax.lax.dynamic_update_slice(self.k, k_new[None], (self.layer, 0, 0, at, 0))
        vc = jax.lax.dynamic_update_slice(self.v, v_new[None], (self.layer, 0, 0, at, 0))
        k_l = jax.lax.dynamic_index_in_dim(kc, self.layer, 0, keepdims=False)  # (B, H_kv, S, D)
        v_l = jax.lax.dynamic_index_in_dim(vc, self.layer, 0, keepdims=False)
        return KVCache(kc, vc, at + t, "stacked", self.layer), k_l, v_l, "heads"


class Attention(nn.Module):
    """Multi-head attention: self-attention, or cross-attention when ``context`` is given.

    Parameters q_proj (d_model -> H*D, D = head_dim or d_model // H), k_proj, v_proj (d_model -> H_kv*D), o_proj (H*D -> d_model).
    """

    d_model: int
    n_head: int
    n_kv_head: int | None = None
    head_dim: int | None = None  # None: d_model // n_head
    qkv_bias: bool = False
    o_bias: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    rope_layout: str = "half"
    rope_scaling: RopeScaling | None = None  # config.RopeScaling; None: plain RoPE
    rope_local_base: float | None = None  # sliding layers' base, without scaling (ModelConfig.rope_local_base)
    rotary_dim: int | None = None  # partial RoPE: the first rotary_dim dims of each head (None: all)
    qk_norm: str | None = None  # config.QK_NORMS: RMSNorm q_norm / k_norm (eps norm_eps) before RoPE
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # q_norm / k_norm scale by 1 + scale (Gemma 3)
    norm_impl: str = "auto"  # config.NORM_IMPLS, for q_norm / k_norm
    attn_dropout: float = 0.0
    init_std: float = 0.02
    out_init_std: float = 0.02
    attention_impl: str = "auto"  # config.ATTENTION_IMPLS
    attention_block: int = 128
    dtype: str = "float32"  # compute dtype of the projections and the attention core
    param_dtype: str = "float32"
    matvec: bool = False  # dense(matvec=): decode-step rows on the matvec kernel (layers not scanned)
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)
    scale: float | None = None  # score multiplier (ModelConfig.attn_scale); None: head_dim ** -0.5
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (attn_softcap)

    @nn.compact
    @module_scope
    def __call__(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
                 return_weights=False, deterministic=True, segment_ids=None, window=None):
        """x: (B, T, d_model); context: (B, S, d_model) for cross-attention.

        positions: (T,) or (B, T) absolute positions for RoPE (default: cache index + arange(T)).
        cache: a KVCache (any layout) to write this call's keys/values into (self-attention only);
        a mask then spans its S slots.
        segment_ids: (B, T) ids of packed documents (self-attention without a cache): a query
        sees only keys of its own document.
        window: this layer's sliding window (None, an int, or a traced int32 scalar under nn.scan;
        kernels.masks.NO_WINDOW for a layer that does not slide): causal attention over the last W positions.
        Returns (y (B, T, d_model), new cache or None, weights (B, H, T, S) or None).
        """
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head} (or set head_dim)")
        h_kv = self.n_kv_head or self.n_head
        d = self.head_dim or self.d_model // self.n_head
        b, t, _ = x.shape
        src = x if context is None else context

        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype, matvec=self.matvec)
        q = dense(self.n_head * d, self.qkv_bias, self.init_std, "q_proj", **dt)(x).reshape(b, t, self.n_head, d)
        k = dense(h_kv * d, self.qkv_bias, self.init_std, "k_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)
        v = dense(h_kv * d, self.qkv_bias, self.init_std, "v_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)

        q, k = qk_norm(self.qk_norm, q, k, eps=self.norm_eps, param_dtype=self.param_dtype, impl=self.norm_impl,
                       unit_offset=self.norm_unit_offset)
        offset = 0 if cache is None else cache.index
        if self.rope:
            if context is not None:
                raise ValueError("RoPE applies to self-attention only")
            if positions is None:
                positions = offset + jnp.arange(t)
            q, k = layer_rope(q, k, positions, window, base=self.rope_base, scaling=self.rope_scaling,
                              local_base=self.rope_local_base, layout=self.rope_layout, rotary_dim=self.rotary_dim)

        kv_layout, pages = "tokens", None
        if cache is not None:  # the caches' one contract: keys, values, layout and mask to attend over
            if context is not None:
                raise ValueError("the KV cache holds self-attention keys; pass context=None")
            if mask is not None:  # checked before the cache's `& written`, whose broadcast could hide a bad shape
                mask = jnp.asarray(mask)
                validate.check_mask(mask.shape, mask.dtype, (b, self.n_head, t, cache.capacity))
            cache, k, v, kv_layout, mask, causal = cache.write(k, v, mask, is_causal, window=window)
            if is_causal and not causal:  # the cache folded causality, and the window, into its mask
                is_causal, window = False, None
            if kv_layout == "pages":  # a paged cache read in place: attend follows its page table
                pages = cache.pages

        rate = 0.0 if deterministic else self.attn_dropout
        out = attend(q, k, v, impl=self.attention_impl, block=self.attention_block, mask=mask, is_causal=is_causal,
                     q_offset=offset, return_weights=return_weights, kv_layout=kv_layout, pages=pages,
                     dropout_rate=rate, dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
                     segment_ids=segment_ids, scale=self.scale, softcap=self.softcap,
                     window=window)
        out, weights = out if return_weights else (out, None)
        y = dense(self.d_model, self.o_bias, self.out_init_std, "o_proj", **dt)(out.reshape(b, t, self.n_head * d))
        return y, cache, weights


def attention_from_config(config, name: str, rope: bool | None = None, execution: Execution = DEFAULT_EXECUTION) -> Attention:
    """The Attention a ModelConfig describes (RoPE on when config.pos == 'rope', unless overridden),
    run with ``execution``'s kernels."""
    return Attention(
        d_model=config.d_model, n_head=config.n_head, n_kv_head=config.kv_heads, head_dim=config.d_head,
        qkv_bias=config.qkv_bias, o_bias=config.o_bias,
        rope=(config.pos == "rope") if rope is None else rope, rope_base=config.rope_base,
        rope_layout=config.rope_layout, rope_scaling=config.rope_scaling, rotary_dim=config.rotary_dim,
        rope_local_base=config.rope_local_base, qk_norm=config.qk_norm, norm_eps=config.norm_eps,
        norm_unit_offset=config.norm_unit_offset,
        norm_impl=execution.norm_impl, attn_dropout=config.attention_dropout, init_std=config.init_std,
        out_init_std=config.out_init_std, attention_impl=execution.attention_impl, attention_block=execution.attention_block,
        dtype=config.dtype, param_dtype=config.param_dtype, matvec=not execution.scan_layers,
        matmul_precision=execution.matmul_precision, scale=config.attn_scale,
        softcap=config.attn_softcap, name=name)
