"""Query/key normalisation mirroring jaxgpt/nn/qk_norm.py: RMSNorms ``q_norm`` / ``k_norm`` (parameter
``scale``) on the projected queries and keys, before RoPE; 'head' over each head's D, 'full' over the
whole projection (H*D, H_kv*D)."""
from __future__ import annotations

from jaxgpt.config import QK_NORMS
from torch_ref.nn.norms import RMSNorm


def qk_norms(kind: str | None, n_head: int, n_kv_head: int, head_dim: int, eps: float, unit_offset: bool = False):
    """(q_norm, k_norm) modules for an Attention, or (None, None) when ``kind`` is None (``unit_offset``:
    scale by 1 + scale, Gemma 3's)."""
    if kind not in QK_NORMS:
        raise ValueError(f"qk_norm={kind!r} is not one of {QK_NORMS}")
    if kind is None:
        return None, None
    if kind == "head":
        return RMSNorm(head_dim, eps, unit_offset), RMSNorm(head_dim, eps, unit_offset)
    return RMSNorm(n_head * head_dim, eps, unit_offset), RMSNorm(n_kv_head * head_dim, eps, unit_offset)


def qk_norm(kind: str | None, q, k, q_norm, k_norm):
    """q: (B, T, H, D), k: (B, S, H_kv, D) normalised by q_norm / k_norm; shapes and dtypes kept."""
    if kind is None:
        return q, k
    if kind == "head":
        return q_norm(q), k_norm(k)
    return q_norm(q.flatten(-2)).view(q.shape), k_norm(k.flatten(-2)).view(k.shape)
