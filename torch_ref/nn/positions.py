"""Position information mirroring jaxgpt/positions.py (same float64-then-float32 constants)."""
from __future__ import annotations

import math

import torch



# RoPE scaling variants mirroring jaxgpt/nn/positions.py: the same float64 math in torch, rounded to float32.
def _llama3(inv: torch.Tensor, s) -> torch.Tensor:
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / s.low_freq_factor, inv / s.factor, inv)  # long wavelengths: interpolated
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    band = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)  # between: blended
    return torch.where(band, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling=None, *, long: bool = False):
    """(inverse frequencies (head_dim // 2,) float32, the cos/sin multiplier); see jaxgpt.nn.rope_scaling."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = None if scaling is None else scaling.rope_type
    if kind == "linear":
        inv = inv / scaling.factor
    elif kind == "yarn":
        low, high = scaling.yarn_ramp(head_dim, base)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        inv = inv / scaling.factor * ramp + inv * (1 - ramp)
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "longrope":
        inv = inv / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
    return inv.float(), 1.0 if scaling is None else scaling.attention_scaling


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
