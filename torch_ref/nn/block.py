"""Transformer block mirroring jaxgpt/block.py (attn_norm, attn, [cross_norm, cross_attn], mlp_norm, mlp)."""
from __future__ import annotations

from torch import nn

from jaxgpt.config import ModelConfig
from torch_ref.nn.attention import attention_from_config
from torch_ref.nn.mlp import make_mlp
from torch_ref.nn.moe import MoE
from torch_ref.nn.norms import make_norm


class Block(nn.Module):
    """Pre-LN: x + f(norm(x)).  Post-LN: norm(x + f(x)).  x: (B, T, d_model)."""

    def __init__(self, config: ModelConfig, causal: bool = True, cross: bool = False, sparse: bool = False):
        super().__init__()
        cfg = self.config = config
        self.causal, self.cross = causal, cross
        norm = lambda: make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.attn_norm, self.attn = norm(), attention_from_config(cfg)
        if cross:
            self.cross_norm, self.cross_attn = norm(), attention_from_config(cfg, rope=False)
        self.mlp_norm, self.mlp = norm(), MoE(cfg) if sparse else make_mlp(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x, f, norm):
        if self.config.norm_placement == "pre":
            return x + self.drop(f(norm(x)))
        return norm(x + self.drop(f(x)))

    def forward(self, x, context=None, *, mask=None, context_mask=None, positions=None, cache=None,
                return_weights=False, segment_ids=None, window=None):
        """Returns (x, new cache or None, self-attention weights or None); window: the self-attention's."""
        if self.cross and context is None:
            raise ValueError("this Block has cross-attention: pass context=(B, S, d_model)")
        out = {}

        def self_attn(h):
            y, out["cache"], out["weights"] = self.attn(h, mask=mask, is_causal=self.causal, positions=positions,
                                                        cache=cache, return_weights=return_weights,
                                                        segment_ids=segment_ids, window=window)
            return y

        x = self._residual(x, self_attn, self.attn_norm)
        if self.cross:
            x = self._residual(x, lambda h: self.cross_attn(h, context, mask=context_mask)[0], self.cross_norm)
        x = self._residual(x, self.mlp, self.mlp_norm)
        return x, out["cache"], out["weights"]
