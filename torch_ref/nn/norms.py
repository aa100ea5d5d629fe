"""LayerNorm and RMSNorm mirroring jaxgpt/norms.py (parameters ``scale`` and ``bias``)."""
from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis. x: (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-5, use_bias: bool = True, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.scale = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if use_bias else None

    def forward(self, x):
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).square().mean(-1, keepdim=True)
        y = (h - mean) / torch.sqrt(var + self.eps) * _gain(self)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis. x: (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.scale = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x):
        h = x.float()
        y = h / torch.sqrt(h.square().mean(-1, keepdim=True) + self.eps) * _gain(self)
        return y.to(x.dtype)


def _gain(norm):
    """The factor a norm scales by: ``scale``, or 1 + scale (float32) with ``unit_offset`` (Gemma)."""
    return 1.0 + norm.scale.float() if norm.unit_offset else norm.scale


def make_norm(kind: str, dim: int, eps: float, use_bias: bool = True, unit_offset: bool = False) -> nn.Module:
    """The norm a config names: 'layernorm' or 'rmsnorm' (``unit_offset``: scale by 1 + scale)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, use_bias=use_bias, unit_offset=unit_offset)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, unit_offset=unit_offset)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


def norm_from_config(config) -> nn.Module:
    """The norm a ModelConfig names (jaxgpt.nn.norms.norm_from_config's twin)."""
    return make_norm(config.norm, config.d_model, config.norm_eps, config.norm_bias, config.norm_unit_offset)
