"""RoPE scaling variants (``ModelConfig.rope_scaling``, jaxgpt/config/rope.py): their inverse frequencies
and the factor cos and sin are multiplied by, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them.

Computed once in float64 NumPy and rounded to float32 (plain RoPE's too): they are constants at
trace time, so a scaled model runs exactly the ops of a plain one.
"""
from __future__ import annotations

import math

import numpy as np

from jaxgpt.config.rope import RopeScaling


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / s.low_freq_factor, inv / s.factor, inv)  # long wavelengths: interpolated
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    band = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)  # between: blended
    return np.where(band, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None,
                     *, long: bool = False) -> tuple[np.ndarray, float]:
    """(inverse frequencies (head_dim // 2,) float32, the cos/sin multiplier) of RoPE with ``scaling``.

    'dynamic' gives plain RoPE's frequencies: HF rescales only past max_position_embeddings, which a
    jaxgpt model's context never passes. ``long``: longrope's ``long_factor`` set (HF's past the
    original context) instead of ``short_factor``.
    """
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = None if scaling is None else scaling.rope_type
    if kind == "linear":
        inv = inv / scaling.factor
    elif kind == "yarn":
        low, high = scaling.yarn_ramp(head_dim, base)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 1: interpolated
        inv = inv / scaling.factor * ramp + inv * (1 - ramp)
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "longrope":
        inv = inv / np.asarray(scaling.long_factor if long else scaling.short_factor, np.float64)
    return inv.astype(np.float32), 1.0 if scaling is None else scaling.attention_scaling


__all__ = ["rope_frequencies"]
