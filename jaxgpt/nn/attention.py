"""The multi-head Attention module (MHA / GQA / MQA, self- and cross-attention, RoPE). The attention
itself is ``kernels.attend``, the one entry to every kernel; a KV cache is any ``kv_cache.KVCacheLike``.

Layout: activations stay (B, T, H, D) from the projections to the output, so no transposes are
needed around the attention core; GQA is an einsum over (kv_head, group) without repeating K/V.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config.execution import DEFAULT_EXECUTION, Execution
from jaxgpt.config.rope import RopeScaling
from jaxgpt.core import validate
from jaxgpt.nn.kernels import attend
from jaxgpt.nn.kernels import causal_mask, scaled_dot_product_attention  # noqa: F401  (public names)
from jaxgpt.nn.kernels.xla import KVRead
from jaxgpt.nn.kv_cache import CACHE_LAYOUTS, KVCache  # noqa: F401  (public names)
from jaxgpt.nn.mlp import dense
from jaxgpt.nn.positions import layer_rope
from jaxgpt.nn.kernels.precision import module_scope
from jaxgpt.nn.qk_norm import qk_norm

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
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)
    scale: float | None = None  # score multiplier (ModelConfig.attn_scale); None: head_dim ** -0.5
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (attn_softcap)

    @nn.compact
    @module_scope
    def __call__(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
                 return_weights=False, deterministic=True, segment_ids=None, window=None):
        """x: (B, T, d_model); context: (B, S, d_model) for cross-attention.

        positions: (T,) or (B, T) absolute positions for RoPE (default: cache index + arange(T)).
        cache: a KV cache (nn/kv_cache.py's contract) to write this call's keys/values into (self-attention only);
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

        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        q = dense(self.n_head * d, self.qkv_bias, self.init_std, "q_proj", **dt)(x).reshape(b, t, self.n_head, d)
        k = dense(h_kv * d, self.qkv_bias, self.init_std, "k_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)
        v = dense(h_kv * d, self.qkv_bias, self.init_std, "v_proj", **dt)(src).reshape(b, src.shape[1], h_kv, d)

        if self.qk_norm is not None:
            q, k = qk_norm(self.qk_norm, q, k, eps=self.norm_eps, param_dtype=self.param_dtype, impl=self.norm_impl,
                           unit_offset=self.norm_unit_offset)
        offset = 0 if cache is None or cache.offset is None else cache.offset  # paged: positions are given
        if self.rope:
            if context is not None:
                raise ValueError("RoPE applies to self-attention only")
            if positions is None:
                positions = offset + jnp.arange(t)
            q, k = layer_rope(q, k, positions, window, base=self.rope_base, scaling=self.rope_scaling,
                              local_base=self.rope_local_base, layout=self.rope_layout, rotary_dim=self.rotary_dim)

        kv = KVRead(k, v, "tokens", mask, is_causal, window)
        if cache is not None:  # the caches' one contract (nn/kv_cache.py): write, then read what to attend over
            if context is not None:
                raise ValueError("the KV cache holds self-attention keys; pass context=None")
            if mask is not None:  # checked before the cache narrows it, whose broadcast could hide a bad shape
                mask = jnp.asarray(mask)
                validate.check_mask(mask.shape, mask.dtype, (b, self.n_head, t, cache.capacity))
            cache = cache.write(k, v)
            kv = cache.read(mask, is_causal, window)

        rate = 0.0 if deterministic else self.attn_dropout
        out = attend(q, kv.k, kv.v, impl=self.attention_impl, block=self.attention_block, mask=kv.mask,
                     is_causal=kv.is_causal, q_offset=offset, return_weights=return_weights, kv_layout=kv.layout,
                     pages=kv.pages, dropout_rate=rate, dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
                     segment_ids=segment_ids, scale=self.scale, softcap=self.softcap, window=kv.window)
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
        dtype=config.dtype, param_dtype=config.param_dtype,
        matmul_precision=execution.matmul_precision, scale=config.attn_scale,
        softcap=config.attn_softcap, name=name)
