"""Transformer block mirroring jaxgpt/block.py (attn_norm, attn, [cross_norm, cross_attn], mlp_norm, mlp)."""
from __future__ import annotations

from torch import nn

from jaxgpt.config import ModelConfig
from torch_ref.nn.attention import attention_from_config
from torch_ref.nn.mlp import make_mlp
from torch_ref.nn.moe import MoE
from torch_ref.nn.norms import norm_from_config


class Block(nn.Module):
    """Pre-LN: x + f(norm(x)).  Post-LN: norm(x + f(x)).  Post-sublayer: x + norm(f(x)).
    Sandwich: x + post_norm(f(norm(x))) (Gemma 2).  Parallel (config.parallel_residual):
    x + attn(attn_norm(x)) + mlp(mlp_norm(x)).  x: (B, T, d_model)."""

    def __init__(self, config: ModelConfig, causal: bool = True, cross: bool = False, sparse: bool = False):
        super().__init__()
        cfg = self.config = config
        self.causal, self.cross = causal, cross
        norm = lambda: norm_from_config(cfg)
        self.attn_norm, self.attn = norm(), attention_from_config(cfg)
        if cross:
            self.cross_norm, self.cross_attn = norm(), attention_from_config(cfg, rope=False)
        self.mlp_norm, self.mlp = norm(), MoE(cfg) if sparse else make_mlp(cfg)
        if cfg.norm_placement == "sandwich":  # a norm after each sublayer too
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()
            if cross:
                self.cross_post_norm = norm()
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x, f, norm, src=None, post=None):
        return residual(self.config.norm_placement, x, f, norm, self.drop, src, post)

    def forward(self, x, context=None, *, mask=None, context_mask=None, positions=None, cache=None,
                return_weights=False, segment_ids=None, window=None):
        """Returns (x, new cache or None, self-attention weights or None); window: the self-attention's."""
        if self.cross and context is None:
            raise ValueError("this Block has cross-attention: pass context=(B, S, d_model)")
        out, layer_in = {}, x

        def self_attn(h):
            y, out["cache"], out["weights"] = self.attn(h, mask=mask, is_causal=self.causal, positions=positions,
                                                        cache=cache, return_weights=return_weights,
                                                        segment_ids=segment_ids, window=window)
            return y

        post = (lambda name: getattr(self, name + "_post_norm", None))
        x = self._residual(x, self_attn, self.attn_norm, post=post("attn"))
        if self.cross:
            x = self._residual(x, lambda h: self.cross_attn(h, context, mask=context_mask)[0], self.cross_norm,
                               post=post("cross"))
        x = self._residual(x, self.mlp, self.mlp_norm, layer_in if self.config.parallel_residual else None,
                           post("mlp"))
        return x, out["cache"], out["weights"]


def residual(placement: str, x, f, norm, drop, src=None, post=None):
    """x (B, T, d_model) plus sublayer ``f``'s branch, as jaxgpt.nn.block.residual: 'pre' x + f(norm(x)),
    'post' norm(x + f(x)), 'post_sublayer' x + norm(f(x)), 'sandwich' x + post(f(norm(x)));
    ``src``: what f reads ('pre' only)."""
    if placement not in ("pre", "post", "post_sublayer", "sandwich"):
        raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre', 'post', 'post_sublayer' or 'sandwich'")
    if placement != "pre" and src is not None:
        raise ValueError(f"a parallel residual needs norm_placement='pre', got {placement!r}")
    if placement == "sandwich":
        return x + drop(post(f(norm(x))))
    inp = x if src is None else src
    if placement == "post":
        return norm(x + drop(f(inp)))
    branch = f(norm(inp)) if placement == "pre" else norm(f(inp))
    return x + drop(branch)
