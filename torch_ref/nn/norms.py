"""LayerNorm and RMSNorm mirroring jaxgpt/norms.py (parameters ``scale`` and ``bias``)."""
from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis. x: (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-5, use_bias: bool = True):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if use_bias else None

    def forward(self, x):
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).square().mean(-1, keepdim=True)
        y = (h - mean) / torch.sqrt(var + self.eps) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis. x: (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        y = h / torch.sqrt(h.square().mean(-1, keepdim=True) + self.eps) * self.scale
        return y.to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, use_bias: bool = True) -> nn.Module:
    """The norm a config names: 'layernorm' or 'rmsnorm'."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, use_bias=use_bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")
