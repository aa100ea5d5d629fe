"""Attention mirroring jaxgpt/nn/attention.py and the 'xla' kernel (jaxgpt/nn/kernels/xla.py): same
function, class, argument and parameter names.

Activations are (B, T, H, D) as in jaxgpt; the fast path hands transposed views to torch's fused
F.scaled_dot_product_attention, the explicit path (attention weights requested) writes the math out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from jaxgpt.core import validate
from torch_ref.nn.mlp import linear
from torch_ref.nn.positions import apply_rope
from torch_ref.nn.qk_norm import qk_norm, qk_norms
from torch_ref.nn.softcap import softcap as capped


@dataclass
class KVCache:
    """Preallocated keys/values (B, H_kv, S, D) and the next write position: jaxgpt's KVCache in its
    'heads' layout, the one layout torch_ref needs (jaxgpt's 'rows' and 'stacked' are about XLA)."""

    k: torch.Tensor
    v: torch.Tensor
    index: int = 0

    @classmethod
    def init(cls, batch: int, n_kv_head: int, max_len: int, head_dim: int, dtype=torch.float32,
             device=None) -> "KVCache":
        shape = (batch, n_kv_head, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), 0)


def causal_mask(q_len: int, k_len: int, q_offset: int = 0, device=None, window: int | None = None) -> torch.Tensor:
    """(q_len, k_len) bool, True where query i (absolute position q_offset + i) may see key j:
    j <= q_offset + i, and (a sliding ``window`` W, transformers' rule) j > q_offset + i - W."""
    keys = torch.arange(k_len, device=device)[None, :]
    queries = torch.arange(q_len, device=device)[:, None] + q_offset
    allowed = keys <= queries
    return allowed if window is None else allowed & (keys > queries - window)


def scaled_dot_product_attention(q, k, v, *, mask=None, is_causal=False, q_offset=0, scale=None,
                                 return_weights=False, kv_layout="tokens", dropout_rate=0.0, softcap=None,
                                 window=None):
    """Same contract as jaxgpt.nn.attention.scaled_dot_product_attention (q: (B, Tq, H, D);
    k, v: (B, Tk, H_kv, D) with kv_layout 'tokens', (B, H_kv, Tk, D) with 'heads'; mask bool,
    True = attend, other dtypes / shapes are a ValueError; rows with no visible key give zeros).
    softcap: scores -> softcap * tanh(scores / softcap) before the mask (written out, not torch's SDPA);
    ``window``: a sliding window on the causal mask.
    Returns out (B, Tq, H, D) [, weights (B, H, Tq, Tk)]."""
    if kv_layout not in ("tokens", "heads"):
        raise ValueError(f"kv_layout={kv_layout!r} is not one of ('tokens', 'heads')")
    b, tq, h, d = q.shape
    qh = q.transpose(1, 2)  # (B, H, Tq, D) views, no copies
    kh, vh = (k, v) if kv_layout == "heads" else (k.transpose(1, 2), v.transpose(1, 2))
    h_kv, tk = kh.shape[1], kh.shape[2]
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    allowed = None if mask is None else torch.as_tensor(mask, device=q.device)
    if allowed is not None:
        validate.check_mask(allowed.shape, allowed.dtype, (b, h, tq, tk))
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    if window is not None and not is_causal:
        raise ValueError("a sliding window narrows causal attention: pass is_causal=True (or window=None)")
    if is_causal:
        c = causal_mask(tq, tk, q_offset, q.device, window)
        allowed = c if allowed is None else allowed & c

    if not return_weights and softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, dropout_p=dropout_rate,
                                             scale=scale, enable_gqa=h != h_kv)
        return out.transpose(1, 2)

    g = h // h_kv
    scale = d ** -0.5 if scale is None else scale
    kr, vr = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    scores = (qh.float() @ kr.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    scores = capped(scores, softcap)  # before the mask, as HF Gemma 2
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1)
    if allowed is not None:
        weights = weights * allowed.any(-1, keepdim=True)
    probs = F.dropout(weights, dropout_rate) if dropout_rate > 0.0 else weights
    out = (probs.to(vr.dtype) @ vr).transpose(1, 2)
    return (out, weights) if return_weights else out


class Attention(nn.Module):
    """Multi-head attention: self-attention, or cross-attention when ``context`` is given."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None, qkv_bias: bool = False,
                 o_bias: bool = False, rope: bool = False, rope_base: float = 10000.0,
                 rope_layout: str = "half", attn_dropout: float = 0.0, init_std: float = 0.02,
                 out_init_std: float = 0.02, head_dim: int | None = None, rotary_dim: int | None = None,
                 qk_norm: str | None = None, norm_eps: float = 1e-6, rope_scaling=None,
                 scale: float | None = None, softcap: float | None = None, rope_local_base: float | None = None,
                 norm_unit_offset: bool = False):
        super().__init__()
        if head_dim is None and d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head} (or set head_dim)")
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        self.head_dim = head_dim or d_model // n_head
        self.rope, self.rope_base, self.rope_layout, self.rotary_dim = rope, rope_base, rope_layout, rotary_dim
        self.rope_scaling = rope_scaling  # a jaxgpt RopeScaling (framework-free); None: plain RoPE
        self.rope_local_base = rope_local_base  # sliding layers' base, without scaling (Gemma 3); None: rope_base
        self.attn_dropout, self.scale, self.softcap = attn_dropout, scale, softcap
        self.q_proj = linear(d_model, n_head * self.head_dim, qkv_bias, init_std)
        self.k_proj = linear(d_model, self.n_kv_head * self.head_dim, qkv_bias, init_std)
        self.v_proj = linear(d_model, self.n_kv_head * self.head_dim, qkv_bias, init_std)
        self.o_proj = linear(n_head * self.head_dim, d_model, o_bias, out_init_std)
        self.qk_norm = qk_norm
        self.q_norm, self.k_norm = qk_norms(qk_norm, n_head, self.n_kv_head, self.head_dim, norm_eps,
                                              norm_unit_offset)

    def forward(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
                return_weights=False, segment_ids=None, window=None):
        """Returns (y (B, T, d_model), cache or None, weights (B, H, T, S) or None).
        window: this layer's sliding window (None: causal attention over every earlier key).
        A given cache is written in place (its buffers) and returned with the index advanced.
        segment_ids (B, T): packed documents, attended as the mask seg_i == seg_j (no cache)."""
        b, t, _ = x.shape
        d, h_kv = self.head_dim, self.n_kv_head
        src = x if context is None else context
        q = self.q_proj(x).view(b, t, self.n_head, d)
        k = self.k_proj(src).view(b, src.shape[1], h_kv, d)
        v = self.v_proj(src).view(b, src.shape[1], h_kv, d)

        q, k = qk_norm(self.qk_norm, q, k, self.q_norm, self.k_norm)
        offset = 0 if cache is None else cache.index
        if self.rope:
            if context is not None:
                raise ValueError("RoPE applies to self-attention only")
            if positions is None:
                positions = offset + torch.arange(t, device=x.device)
            local = self.rope_local_base is not None and window is not None
            rope = dict(base=self.rope_local_base if local else self.rope_base, layout=self.rope_layout,
                        scaling=None if local else self.rope_scaling, rotary_dim=self.rotary_dim)
            q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)

        kv_layout = "tokens"
        if cache is not None:
            if context is not None:
                raise ValueError("the KV cache holds self-attention keys; pass context=None")
            validate.check_cache_room(offset, t, cache.k.shape[2])
            cache.k[:, :, offset:offset + t] = k.transpose(1, 2)
            cache.v[:, :, offset:offset + t] = v.transpose(1, 2)
            cache = KVCache(cache.k, cache.v, offset + t)
            # Read only the filled prefix: same result as masking the empty slots, less work.
            k, v, kv_layout = cache.k[:, :, :offset + t], cache.v[:, :, :offset + t], "heads"
            if mask is not None:  # a mask spans the cache's S slots, as in jaxgpt
                mask = torch.as_tensor(mask, device=x.device)
                validate.check_mask(mask.shape, mask.dtype, (b, self.n_head, t, cache.k.shape[2]))
                mask = mask[..., :offset + t]

        if segment_ids is not None:
            if cache is not None or context is not None:
                raise ValueError("segment_ids pack documents into self-attention without a KV cache")
            segment_ids = torch.as_tensor(segment_ids, device=x.device)
            validate.check_segment_ids(segment_ids.shape, segment_ids.dtype, (b, t))
            same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (B, 1, T, T)
            mask = same if mask is None else torch.as_tensor(mask, device=x.device) & same
        rate = self.attn_dropout if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, q_offset=offset,
                                           return_weights=return_weights, kv_layout=kv_layout,
                                           dropout_rate=rate, scale=self.scale, softcap=self.softcap, window=window)
        out, weights = out if return_weights else (out, None)
        return self.o_proj(out.reshape(b, t, self.n_head * d)), cache, weights


def attention_from_config(config, rope: bool | None = None) -> Attention:
    """The Attention a ModelConfig describes (RoPE on when config.pos == 'rope', unless overridden)."""
    return Attention(d_model=config.d_model, n_head=config.n_head, n_kv_head=config.kv_heads,
                     qkv_bias=config.qkv_bias, o_bias=config.o_bias,
                     rope=(config.pos == "rope") if rope is None else rope, rope_base=config.rope_base,
                     rope_layout=config.rope_layout, attn_dropout=config.attention_dropout,
                     init_std=config.init_std, out_init_std=config.out_init_std, head_dim=config.d_head,
                     rotary_dim=config.rotary_dim, qk_norm=config.qk_norm, norm_eps=config.norm_eps,
                     rope_scaling=config.rope_scaling,
                     scale=config.attn_scale, softcap=config.attn_softcap, rope_local_base=config.rope_local_base,
                     norm_unit_offset=config.norm_unit_offset)
