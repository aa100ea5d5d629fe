"""Scaled dot-product attention (pure) and the multi-head Attention module (MHA / GQA / MQA,
self- and cross-attention, RoPE, explicit KV cache).

Layout: activations stay (B, T, H, D) from the projections to the output, so no transposes are
needed around the attention core; GQA is an einsum over (kv_head, group) without repeating K/V.
The KV cache is (B, H_kv, S, D), the layout the decode step reads contiguously per head.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.nn import checks
from jaxgpt.core import validate
from jaxgpt.nn.kernels import blocked_attention, grouped_mask, jax_attention, warn_once
from jaxgpt.config import ATTENTION_IMPLS
from jaxgpt.nn.mlp import dense
from jaxgpt.nn.positions import apply_rope


class KVCache(NamedTuple):
    """Preallocated keys/values and how many positions are already written. A pytree."""

    # k, v: (B, H_kv, S, D); (L, B, H_kv, S, D) when `layer` is set; or (B * H_kv, S, D), row
    # b * H_kv + h, for the per-layer decode caches of init_cache(..., per_layer=True) (cached_attention).
    k: jax.Array
    v: jax.Array
    index: jax.Array  # () int32: next write position == number of cached positions
    # Layer of a layer-stacked cache this call owns (the decoder's layer loop sets it): the call writes
    # only its new slots of k[layer] / v[layer] in place, so a decode step never copies the whole cache.
    layer: jax.Array | int | None = None

    @classmethod
    def init(cls, batch: int, n_kv_head: int, max_len: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, n_kv_head, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def cached_attention(q, kc, vc, *, offset, mask=None, is_causal=True, return_weights=False):
    """Attention of q (B, T, H, D) over a per-layer cache kc, vc (B * H_kv, S, D) whose slots
    [0, offset + T) are written; the same math as scaled_dot_product_attention (float32 scores and
    softmax; rows with no visible key give zeros). mask: bool broadcastable to (B, H, T, S).

    Why a layout of its own: the dots read the cache as one (B * H_kv) batch of (S, D) matrices,
    the layout XLA's CPU dot takes as is. With (B, H_kv, S, D) XLA reshaped the freshly updated
    cache for the dot (a size-1 batch dropped, or batch and heads merged) and fused the update a
    second time into that reshape, which copies the whole cache per layer and token.
    Returns out (B, T, H, D), and weights (B, H, T, S) float32 if ``return_weights``.
    """
    b, t, h, d = q.shape
    n, s_len, _ = kc.shape
    h_kv = n // b
    g = h // h_kv
    qn = q.reshape(b, t, h_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(n, g * t, d)  # head = kv_head * g + group
    scores = jnp.einsum("nqd,nkd->nqk", qn, kc, preferred_element_type=jnp.float32) * d ** -0.5
    scores = scores.reshape(b, h_kv, g, t, s_len)
    allowed = jnp.arange(s_len) < offset + t  # (S,): written slots
    if is_causal:
        allowed = allowed & causal_mask(t, s_len, offset)  # (T, S)
    if mask is not None:
        m = jnp.asarray(mask)
        validate.check_mask(m.shape, m.dtype, (b, h, t, s_len))
        allowed = allowed & grouped_mask(m, h_kv, g)  # (B|1, H_kv|1, G|1, T|1, S)
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    weights = jnp.where(allowed.any(-1, keepdims=True), jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("nqk,nkd->nqd", weights.reshape(n, g * t, s_len).astype(vc.dtype), vc)  # (N, G*T, D)
    out = out.reshape(b, h_kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    if return_weights:
        return out, weights.reshape(b, h, t, s_len)
    return out


def causal_mask(q_len: int, k_len: int, q_offset=0):
    """(q_len, k_len) bool, True where query i (absolute position q_offset + i) may see key j."""
    return jnp.arange(k_len)[None, :] <= jnp.arange(q_len)[:, None] + q_offset


def scaled_dot_product_attention(q, k, v, *, mask=None, is_causal=False, q_offset=0, scale=None,
                                 return_weights=False, kv_heads_first=False, dropout_rate=0.0,
                                 dropout_rng=None):
    """softmax(q k^T * scale + mask) v, per head, with grouped key/value heads.

    q: (B, Tq, H, D). k, v: (B, Tk, H_kv, D), or (B, H_kv, Tk, D) when ``kv_heads_first`` (the
    KV-cache layout). H must be a multiple of H_kv (GQA; H_kv = 1 is MQA).
    mask: bool, broadcastable to (B, H, Tq, Tk); True means *attend*. Any other dtype or shape is a
    ValueError (a float 0/-inf mask cast to bool would invert it; a (B, T) mask would be read as (Tq, Tk)).
    is_causal: query i sees keys j <= q_offset + i (q_offset may be a traced cache index).
    scale: defaults to 1/sqrt(D).
    A query row with no visible key returns zeros (as torch's SDPA does), not the mean of v.
    Returns out (B, Tq, H, D), and weights (B, H, Tq, Tk) float32 if ``return_weights``.
    """
    b, tq, h, d = q.shape
    kspec = "bhkd" if kv_heads_first else "bkhd"
    h_kv = k.shape[1] if kv_heads_first else k.shape[2]
    tk = k.shape[2] if kv_heads_first else k.shape[1]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    g = h // h_kv
    scale = d ** -0.5 if scale is None else scale

    qg = q.reshape(b, tq, h_kv, g, d)  # head = kv_head * g + group, as torch's enable_gqa
    scores = jnp.einsum(f"bqhgd,{kspec}->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale

    allowed = None
    if mask is not None:
        m = jnp.asarray(mask)
        validate.check_mask(m.shape, m.dtype, (b, h, tq, tk))
        allowed = grouped_mask(m, h_kv, g)  # (B|1, H_kv|1, G|1, Tq|1, Tk)
    if is_causal:
        c = causal_mask(tq, tk, q_offset)
        allowed = c if allowed is None else allowed & c
    if allowed is not None:
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # (B, H_kv, G, Tq, Tk)
    if mask is not None:  # causal alone always leaves key 0 visible (q_offset >= 0): no empty rows
        weights = jnp.where(allowed.any(-1, keepdims=True), weights, 0.0)
    probs = weights
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    vspec = "bhkd" if kv_heads_first else "bkhd"
    out = jnp.einsum(f"bhgqk,{vspec}->bqhgd", probs.astype(v.dtype), v).reshape(b, tq, h, d)
    if return_weights:
        return out, weights.reshape(b, h, tq, tk)
    return out


def attention_core(q, k, v, *, impl="xla", block=512, mask=None, is_causal=False, q_offset=0, scale=None,
                   return_weights=False, kv_heads_first=False, dropout_rate=0.0, dropout_rng=None):
    """scaled_dot_product_attention's contract, computed by the backend ``impl`` (ATTENTION_IMPLS):
    'xla' the einsum above; 'jax' / 'cudnn' jax.nn.dot_product_attention; 'blocked' flash-style
    attention in ``block``-long blocks (attention_backends.py). All give the same numbers.
    Only 'xla' builds the weights, so ``return_weights`` runs 'xla' for that call."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not one of {ATTENTION_IMPLS}")
    kw = dict(mask=mask, is_causal=is_causal, q_offset=q_offset, scale=scale, kv_heads_first=kv_heads_first)
    if impl == "xla" or return_weights:
        return scaled_dot_product_attention(q, k, v, return_weights=return_weights, dropout_rate=dropout_rate,
                                            dropout_rng=dropout_rng, **kw)
    if dropout_rate > 0.0:
        if impl == "blocked":
            raise ValueError(f"attention_impl='blocked' has no attention dropout (attn_dropout={dropout_rate} "
                             f"while training); set attn_dropout=0.0 or attention_impl='xla'")
        warn_once(f"attention_impl={impl!r} has no attention dropout: training with attn_dropout="
                  f"{dropout_rate} runs the 'xla' attention instead")
        return scaled_dot_product_attention(q, k, v, dropout_rate=dropout_rate, dropout_rng=dropout_rng, **kw)
    if mask is not None:
        b, tq, h, _ = q.shape
        m = jnp.asarray(mask)
        validate.check_mask(m.shape, m.dtype, (b, h, tq, k.shape[2] if kv_heads_first else k.shape[1]))
    if impl == "blocked":
        return blocked_attention(q, k, v, block=block, **kw)
    return jax_attention(q, k, v, implementation="cudnn" if impl == "cudnn" else None, **kw)


class Attention(nn.Module):
    """Multi-head attention: self-attention, or cross-attention when ``context`` is given.

    Parameters q_proj (d_model -> H*D), k_proj, v_proj (d_model -> H_kv*D), o_proj (H*D -> d_model).
    """

    d_model: int
    n_head: int
    n_kv_head: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    rope_layout: str = "half"
    attn_dropout: float = 0.0
    init_std: float = 0.02
    out_init_std: float = 0.02
    attention_impl: str = "xla"  # config.ATTENTION_IMPLS
    attention_block: int = 512
    dtype: str = "float32"  # compute dtype of the projections and the attention core
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
                 return_weights=False, deterministic=True):
        """x: (B, T, d_model); context: (B, S, d_model) for cross-attention.

        positions: (T,) or (B, T) absolute positions for RoPE (default: cache index + arange(T)).
        cache: a KVCache to write this call's keys/values into (self-attention only).
        Returns (y (B, T, d_model), new cache or None, weights (B, H, T, S) or None).
        """
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        h_kv = self.n_kv_head or self.n_head
        d = self.d_model // self.n_head
        b, t, _ = x.shape
        src = x if context is None else context

        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        q = dense(self.n_head * d, self.qkv_bias, self.init_std, "q_proj", **dt)(x).reshape(b, t, self.n_head, d)
        k = dense(h_kv * d, self.qkv_bias, self.init_std, "k_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)
        v = dense(h_kv * d, self.qkv_bias, self.init_std, "v_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)

        offset = 0 if cache is None else cache.index
        if cache is not None:  # dynamic_update_slice would clamp the start and overwrite the last slots
            if checks.is_traced(offset):
                checks.check_cache_room(offset, t, cache.k.shape[-2])  # checked mode (checkify) only
            else:
                validate.check_cache_room(int(offset), t, cache.k.shape[-2])
        if self.rope:
            if context is not None:
                raise ValueError("RoPE applies to self-attention only")
            if positions is None:
                positions = offset + jnp.arange(t)
            q = apply_rope(q, positions, base=self.rope_base, layout=self.rope_layout)
            k = apply_rope(k, positions, base=self.rope_base, layout=self.rope_layout)

        kv_heads_first = False
        if cache is not None:
            if context is not None:
                raise ValueError("the KV cache holds self-attention keys; pass context=None")
            # (B, T, H_kv, D) -> (B, H_kv, T, D): only the new tokens are transposed.
            k_new = k.transpose(0, 2, 1, 3).astype(cache.k.dtype)
            v_new = v.transpose(0, 2, 1, 3).astype(cache.v.dtype)
            if cache.k.ndim == 3:  # per-layer decode cache (B * H_kv, S, D): the copy-free path
                if cache.k.shape[0] != b * h_kv:
                    raise ValueError(f"a per-layer KV cache of {cache.k.shape[0]} rows does not fit batch {b} x "
                                     f"{h_kv} key/value heads")
                if not deterministic and self.attn_dropout > 0.0:
                    raise ValueError(f"a per-layer KV cache is for inference: attn_dropout={self.attn_dropout} "
                                     f"with deterministic=False; decode with deterministic=True")
                kc = jax.lax.dynamic_update_slice(cache.k, k_new.reshape(b * h_kv, t, d), (0, offset, 0))
                vc = jax.lax.dynamic_update_slice(cache.v, v_new.reshape(b * h_kv, t, d), (0, offset, 0))
                out = cached_attention(q, kc, vc, offset=offset, mask=mask, is_causal=is_causal,
                                       return_weights=return_weights)
                out, weights = out if return_weights else (out, None)
                y = dense(self.d_model, self.o_bias, self.out_init_std, "o_proj", **dt)(out.reshape(b, t, self.n_head * d))
                return y, KVCache(kc, vc, offset + t), weights
            if cache.layer is None:
                kc = jax.lax.dynamic_update_slice(cache.k, k_new, (0, 0, offset, 0))
                vc = jax.lax.dynamic_update_slice(cache.v, v_new, (0, 0, offset, 0))
                k, v = kc, vc  # (B, H_kv, S, D)
            else:  # (L, B, H_kv, S, D): write T slots of this layer in place, then read its slice
                at = (cache.layer, 0, 0, offset, 0)
                kc = jax.lax.dynamic_update_slice(cache.k, k_new[None], at)
                vc = jax.lax.dynamic_update_slice(cache.v, v_new[None], at)
                k = jax.lax.dynamic_index_in_dim(kc, cache.layer, 0, keepdims=False)  # (B, H_kv, S, D)
                v = jax.lax.dynamic_index_in_dim(vc, cache.layer, 0, keepdims=False)
            cache = KVCache(kc, vc, offset + t, cache.layer)
            kv_heads_first = True
            filled = jnp.arange(k.shape[2]) < offset + t  # slots past the write index are empty
            if mask is not None:  # a mask spans the cache's S slots
                mask = jnp.asarray(mask)
                validate.check_mask(mask.shape, mask.dtype, (b, self.n_head, t, k.shape[2]))
            mask = filled if mask is None else mask & filled

        rate = 0.0 if deterministic else self.attn_dropout
        out = attention_core(
            q, k, v, impl=self.attention_impl, block=self.attention_block, mask=mask, is_causal=is_causal,
            q_offset=offset, return_weights=return_weights, kv_heads_first=kv_heads_first, dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if rate > 0.0 else None)
        out, weights = out if return_weights else (out, None)
        y = dense(self.d_model, self.o_bias, self.out_init_std, "o_proj", **dt)(out.reshape(b, t, self.n_head * d))
        return y, cache, weights


def attention_from_config(config, name: str, rope: bool | None = None) -> Attention:
    """The Attention a ModelConfig describes (RoPE on when config.pos == 'rope', unless overridden)."""
    return Attention(
        d_model=config.d_model, n_head=config.n_head, n_kv_head=config.kv_heads,
        qkv_bias=config.qkv_bias, o_bias=config.o_bias,
        rope=(config.pos == "rope") if rope is None else rope, rope_base=config.rope_base,
        rope_layout=config.rope_layout, attn_dropout=config.attention_dropout,
        init_std=config.init_std, out_init_std=config.out_init_std, attention_impl=config.attention_impl,
        attention_block=config.attention_block, dtype=config.dtype, param_dtype=config.param_dtype, name=name)
