"""Position information mirroring jaxgpt/positions.py (same float64-then-float32 constants)."""
from __future__ import annotations

import math

import torch

from torch_ref.nn.rope_scaling import rope_frequencies


def sinusoidal_table(max_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(max_len, d_model) float32: PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(...)."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(base) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table.float()


def rope_cos_sin(positions, head_dim: int, base: float = 10000.0, scaling=None):
    """cos and sin of position * theta, each (..., head_dim // 2) float32 (times ``scaling``'s attention scaling)."""
    positions = torch.as_tensor(positions)
    inv, attn = rope_frequencies(head_dim, base, scaling)
    angles = positions.float()[..., None] * inv.to(positions.device)
    if attn == 1.0:
        return torch.cos(angles), torch.sin(angles)
    return torch.cos(angles) * attn, torch.sin(angles) * attn


def apply_rope(x, positions, *, base: float = 10000.0, layout: str = "half", scaling=None,
               rotary_dim: int | None = None):
    """Rotate x: (B, T, H, D) by positions: (T,) or (B, T). Same layouts, ``scaling`` and partial
    ``rotary_dim`` as jaxgpt.apply_rope."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], positions, base=base, layout=layout, scaling=scaling)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    d = x.shape[-1]
    cos, sin = rope_cos_sin(positions, d, base, scaling)
    cos, sin = cos[..., None, :], sin[..., None, :]
    if cos.dim() == 3:
        cos, sin = cos[None], sin[None]
    h = x.float()
    if layout == "half":
        x1, x2 = h[..., : d // 2], h[..., d // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    elif layout == "interleaved":
        x1, x2 = h[..., 0::2], h[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).reshape(h.shape)
    else:
        raise ValueError(f"unknown rope layout {layout!r}; expected 'half' or 'interleaved'")
    return out.to(x.dtype)
