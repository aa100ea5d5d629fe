"""Position information: sinusoidal tables, learned tables (an ``nn.Embed``) and RoPE.

Tables and inverse frequencies are computed once in float64 NumPy and rounded to float32, so the
Flax and torch sides start from bit-identical constants; only the runtime products
(position * frequency, cos, sin) are done in float32 by each framework.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxgpt.config.rope import RopeScaling
from jaxgpt.nn.kernels.masks import NO_WINDOW


# RoPE scaling variants (ModelConfig.rope_scaling, jaxgpt/config/rope.py): their inverse frequencies and the
# factor cos and sin are multiplied by, as transformers' ROPE_INIT_FUNCTIONS compute them.
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


def sinusoidal_table(max_len: int, d_model: int, base: float = 10000.0) -> np.ndarray:
    """(max_len, d_model) float32: PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(...)."""
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(base) / d_model))
    table = np.zeros((max_len, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(pos * div)
    table[:, 1::2] = np.cos(pos * div)
    return table.astype(np.float32)


def rope_cos_sin(positions, head_dim: int, base: float = 10000.0, scaling=None):
    """cos and sin of position * theta, each (..., head_dim // 2) float32. positions: (...,) ints.
    ``scaling``: a RopeScaling (its frequencies, and cos and sin times its attention scaling, as HF's)."""
    inv, attn = rope_frequencies(head_dim, base, scaling)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv)
    if attn == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * np.float32(attn), jnp.sin(angles) * np.float32(attn)


def apply_rope(x, positions, *, base: float = 10000.0, layout: str = "half", scaling=None,
               rotary_dim: int | None = None):
    """Rotate queries or keys by their absolute positions.

    x: (B, T, H, D); positions: (T,) or (B, T) integer positions (any offset, e.g. a cache index).
    layout 'half' pairs dimension i with i + D/2 (HF LLaMA's rotate_half); 'interleaved' pairs
    2i with 2i+1 (the complex-number form of seed 000 and Meta's LLaMA). ``scaling``: a RopeScaling
    (jaxgpt/config/rope.py) or None for plain RoPE. ``rotary_dim`` (partial rotary, GPT-NeoX / Phi):
    only the first rotary_dim dims rotate, as a head of that width (its own frequencies and layout),
    the rest pass through. Returns x's shape/dtype.
    """
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], positions, base=base, layout=layout, scaling=scaling)
        return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
    d = x.shape[-1]
    cos, sin = rope_cos_sin(positions, d, base, scaling)  # (T, D/2) or (B, T, D/2)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    if cos.ndim == 3:  # (T, 1, D/2) -> (1, T, 1, D/2)
        cos, sin = cos[None], sin[None]
    h = x.astype(jnp.float32)
    if layout == "half":
        x1, x2 = h[..., : d // 2], h[..., d // 2 :]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    elif layout == "interleaved":
        x1, x2 = h[..., 0::2], h[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(h.shape)
    else:
        raise ValueError(f"unknown rope layout {layout!r}; expected 'half' or 'interleaved'")
    return out.astype(x.dtype)


def layer_rope(q, k, positions, window, *, base: float, scaling, local_base: float | None, layout: str,
               rotary_dim: int | None):
    """(q, k) rotated by one layer's RoPE: a sliding layer (``window`` an int, or a traced int32 other
    than kernels.masks.NO_WINDOW) with ``local_base`` set uses base local_base and no scaling (Gemma 3's
    local layers); every other layer base and scaling. q: (B, T, H, D), k: (B, T, H_kv, D)."""
    def rotate(b, s):
        kw = dict(base=b, layout=layout, scaling=s, rotary_dim=rotary_dim)
        return apply_rope(q, positions, **kw), apply_rope(k, positions, **kw)

    if local_base is None or window is None:
        return rotate(base, scaling)
    if isinstance(window, (int, np.integer)):
        return rotate(local_base, None)
    slides = window != NO_WINDOW  # a scanned layer's window: compute both, keep this layer's
    (ql, kl), (qg, kg) = rotate(local_base, None), rotate(base, scaling)
    return jnp.where(slides, ql, qg), jnp.where(slides, kl, kg)
