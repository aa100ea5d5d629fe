"""Query/key normalisation (``ModelConfig.qk_norm``): an RMSNorm on the projected queries and keys,
before RoPE, so attention logits stay bounded however large the projections grow.

'head' (Qwen3): over each head's D, one scale (D,) shared by the heads. 'full' (OLMo 2): over the
whole projection before it is split into heads, scales (H*D,) for q and (H_kv*D,) for k.
"""
from __future__ import annotations

from jaxgpt.config import QK_NORMS
from jaxgpt.nn.norms import RMSNorm


def qk_norm(kind: str | None, q, k, *, eps: float, param_dtype: str = "float32", impl: str = "auto",
            unit_offset: bool = False):
    """(q, k) normalised by RMSNorm submodules ``q_norm`` and ``k_norm`` of the calling module
    (call it inside a compact method; ``unit_offset``: scale by 1 + scale, Gemma 3's).
    q: (B, T, H, D), k: (B, S, H_kv, D); shapes and dtypes kept."""
    if kind not in QK_NORMS:
        raise ValueError(f"qk_norm={kind!r} is not one of {QK_NORMS}")
    if kind is None:
        return q, k

    def norm(x, name):
        n = RMSNorm(eps=eps, param_dtype=param_dtype, impl=impl, unit_offset=unit_offset, name=name)
        return n(x) if kind == "head" else n(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)

    return norm(q, "q_norm"), norm(k, "k_norm")
