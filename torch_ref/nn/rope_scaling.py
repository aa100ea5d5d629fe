"""RoPE scaling variants mirroring jaxgpt/nn/rope_scaling.py: the same float64 math in torch, rounded to float32."""
from __future__ import annotations

import math

import torch


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
