"""Attention Residuals mirroring jaxgpt/attnres.py (same classes, parameter names and schedule;
see that module for the 'seed' and 'paper' formulations)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jaxgpt.config import ModelConfig
from jaxgpt.core.layout import key_eps, seal_schedule
from torch_ref.nn.attention import attention_from_config
from torch_ref.nn.mlp import make_mlp
from torch_ref.nn.norms import norm_from_config


class KeyNorm(nn.Module):
    """RMSNorm of the depth-attention keys, optional gain ``scale``. x: (..., d)."""

    def __init__(self, dim: int, eps: float, gain: bool = True):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x):
        h = x.float()
        y = h / torch.sqrt(h.square().mean(-1, keepdim=True) + self.eps)
        if self.scale is not None:
            y = y * self.scale
        return y.to(x.dtype)


def depth_attention(query, key_norm, sources):
    """query (d,), sources (N, B, T, d) -> (h (B, T, d), alpha (N, B, T)); softmax over N."""
    logits = torch.einsum("d,nbtd->nbt", query, key_norm(sources))  # (N, B, T)
    alpha = F.softmax(logits, dim=0)
    return torch.einsum("nbt,nbtd->btd", alpha, sources), alpha


def pad_depth_weights(alphas):
    """[(N_q, B, T)] per query -> (Q, B, T, N_max), zero beyond each query's N_q sources."""
    n = max(a.shape[0] for a in alphas)
    return torch.stack([F.pad(a, (0, 0, 0, 0, 0, n - a.shape[0])) for a in alphas]).permute(0, 2, 3, 1)


class AttnResLayer(nn.Module):
    """One transformer layer: attn_norm, attn, mlp_norm, mlp, w_attn, w_mlp and key_norm (seed)
    or attn_key_norm / mlp_key_norm (paper)."""

    def __init__(self, config: ModelConfig, seal: str | None = None):
        super().__init__()
        cfg = self.config = config
        self.seal = seal
        self.seed, self.full = cfg.attnres_variant == "seed", cfg.residual == "full_attnres"
        d, eps, gain = cfg.d_model, key_eps(cfg), cfg.attnres_key_gain
        self.attn_norm, self.attn = norm_from_config(cfg), attention_from_config(cfg)
        self.mlp_norm, self.mlp = norm_from_config(cfg), make_mlp(cfg)
        self.w_attn, self.w_mlp = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        if self.seed:
            self.key_norm = KeyNorm(d, eps, gain)
        else:
            self.attn_key_norm, self.mlp_key_norm = KeyNorm(d, eps, gain), KeyNorm(d, eps, gain)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, sources, partial, *, mask=None, positions=None, return_weights=False, segment_ids=None):
        """Same contract as jaxgpt's AttnResLayer: (sources, partial, weights, [alpha] x 2)."""
        out = {}

        def attn(h):
            y, _, out["weights"] = self.attn(h, mask=mask, is_causal=True, positions=positions,
                                             return_weights=return_weights, segment_ids=segment_ids)
            return y

        alphas = []
        for kind, f in (("attn", attn), ("mlp", self.mlp)):
            key_norm = self.key_norm if self.seed else getattr(self, f"{kind}_key_norm")
            srcs = sources if partial is None else sources + [partial]
            h, alpha = depth_attention(getattr(self, f"w_{kind}"), key_norm, torch.stack(srcs))
            alphas.append(alpha)
            y = self.drop(f(getattr(self, f"{kind}_norm")(h)))  # (B, T, d)
            if self.full:
                sources = sources + [y]
                continue
            partial = y if partial is None else partial + y
            if self.seal == kind:
                sources, partial = sources + [partial], (torch.zeros_like(partial) if self.seed else None)
        return sources, partial, out["weights"], alphas


class AttnResLayers(nn.Module):
    """layers.{i} (+ w_out, out_key_norm in 'paper'). ``forward(x)`` -> (h, weights[, depth])
    exactly as jaxgpt's AttnResLayers."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        self.seed, self.full = cfg.attnres_variant == "seed", cfg.residual == "full_attnres"
        self.layers = nn.ModuleList(AttnResLayer(cfg, seal) for seal in seal_schedule(cfg))
        if not self.seed:
            self.w_out = nn.Parameter(torch.zeros(cfg.d_model))
            self.out_key_norm = KeyNorm(cfg.d_model, key_eps(cfg), cfg.attnres_key_gain)

    def forward(self, x, *, mask=None, positions=None, return_weights=False, return_depth_weights=False,
                segment_ids=None):
        sources = [x]  # (B, T, d) each
        partial = torch.zeros_like(x) if self.seed and not self.full else None
        weights, alphas = [], []
        for layer in self.layers:
            sources, partial, w, a = layer(sources, partial, mask=mask, positions=positions,
                                           return_weights=return_weights, segment_ids=segment_ids)
            weights.append(w)
            alphas += a
        if self.seed and self.full:
            h = sources[-1]
        elif self.seed:
            h = torch.where(partial.abs().sum() > 0, partial, sources[-1])
        else:
            srcs = sources if partial is None else sources + [partial]
            h, alpha = depth_attention(self.w_out, self.out_key_norm, torch.stack(srcs))
            alphas.append(alpha)
        weights = torch.stack(weights) if return_weights else None
        if return_depth_weights:
            return h, weights, pad_depth_weights(alphas)  # (Q, B, T, N_max)
        return h, weights
