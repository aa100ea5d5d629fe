"""Transformer block: self-attention (+ optional cross-attention) and a feed-forward network,
each wrapped in a residual (``residual``: the norm before, after or inside the add; parallel)."""
from __future__ import annotations

import flax.linen as nn

from jaxgpt.nn.attention import attention_from_config
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.nn.mlp import make_mlp
from jaxgpt.nn.moe import MoE
from jaxgpt.nn.norms import norm_from_config
from jaxgpt.nn.kernels.precision import module_scope


class Block(nn.Module):
    """Pre-LN: x + f(norm(x)).  Post-LN: norm(x + f(x)).  Post-sublayer: x + norm(f(x)).
    Sandwich: x + post(f(norm(x))).  Parallel (config.parallel_residual): x + attn(attn_norm(x)) +
    mlp(mlp_norm(x)).  x: (B, T, d_model).

    Submodules: attn_norm, attn, [cross_norm, cross_attn], mlp_norm, mlp (a MoE when ``sparse``);
    sandwich adds attn_post_norm, [cross_post_norm], mlp_post_norm.
    """

    config: ModelConfig
    execution: Execution = Execution()  # the kernels (jaxgpt.config.execution)
    causal: bool = True
    cross: bool = False
    sparse: bool = False  # the feed-forward network is a Mixture of Experts (config.sparse_layer(i))

    @nn.compact
    @module_scope
    def __call__(self, x, context=None, *, mask=None, context_mask=None, positions=None, cache=None,
                 return_weights=False, deterministic=True, segment_ids=None, window=None):
        """mask: self-attention mask (True = attend); context (B, S, d_model) and context_mask
        feed the cross-attention; segment_ids (B, T): packed documents in the self-attention; window: the
        self-attention's sliding window (Attention's). Returns (x, new cache or None, self-attention weights or None)."""
        cfg, ex = self.config, self.execution
        if self.cross and context is None:
            raise ValueError("this Block has cross-attention: pass context=(B, S, d_model)")
        drop = nn.Dropout(cfg.dropout)
        layer_in = x

        def sublayer(x, f, norm_name, src=None):
            post = norm_from_config(cfg, norm_name.replace("_norm", "_post_norm"), ex) \
                if cfg.norm_placement == "sandwich" else None
            return residual(cfg.norm_placement, x, f, norm_from_config(cfg, norm_name, ex),
                            lambda y: drop(y, deterministic=deterministic), src, post)

        out = {}

        def self_attn(h):
            y, out["cache"], out["weights"] = attention_from_config(cfg, "attn", execution=ex)(
                h, mask=mask, is_causal=self.causal, positions=positions, cache=cache,
                return_weights=return_weights, deterministic=deterministic, segment_ids=segment_ids, window=window)
            return y

        x = sublayer(x, self_attn, "attn_norm")
        if self.cross:
            cross = attention_from_config(cfg, "cross_attn", rope=False, execution=ex)
            x = sublayer(x, lambda h: cross(h, context, mask=context_mask, deterministic=deterministic)[0],
                         "cross_norm")
        mlp = MoE(cfg, name="mlp") if self.sparse else make_mlp(cfg, "mlp", ex)
        x = sublayer(x, mlp, "mlp_norm", layer_in if cfg.parallel_residual else None)
        return x, out["cache"], out["weights"]


def residual(placement: str, x, f, norm, drop, src=None, post=None):
    """x (B, T, d_model) plus sublayer ``f``'s branch; ``drop`` is the residual-branch dropout.

    'pre': x + f(norm(x)); 'post': norm(x + f(x)); 'post_sublayer': x + norm(f(x)) (OLMo 2);
    'sandwich': x + post(f(norm(x))) (Gemma 2). ``src``: what f reads instead of x (a parallel
    residual's MLP reads the layer's input, 'pre' only).
    """
    h = x if src is None else src
    if placement == "pre":
        return x + drop(f(norm(h)))
    if src is not None:
        raise ValueError(f"a parallel residual needs norm_placement='pre', got {placement!r}")
    if placement == "sandwich":
        return x + drop(post(f(norm(x))))
    if placement == "post_sublayer":
        return x + drop(norm(f(x)))
    if placement == "post":
        return norm(x + drop(f(x)))
    raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre', 'post', 'post_sublayer' or 'sandwich'")
