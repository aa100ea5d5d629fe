"""Positions: sinusoidal table (seed formula), RoPE in both layouts vs torch_ref, vs HF LLaMA's
rotate_half and vs the seed's complex-number RoPE, and RoPE's relative-position property."""
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import assert_close, assert_self_consistent
from jaxgpt.nn import positions as P
from torch_ref.nn import positions as TP


def _seed_sinusoidal(max_len, d):
    # Seed 000 / 004 formula, float32 torch as the seeds run it.
    pe = torch.zeros(max_len, d)
    position = torch.arange(0, max_len).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


@pytest.mark.parametrize("max_len,d", [(64, 16), (128, 64), (32, 6)])
def test_sinusoidal_table(max_len, d):
    table = P.sinusoidal_table(max_len, d)
    assert table.dtype == np.float32 and table.shape == (max_len, d)
    assert np.array_equal(table, TP.sinusoidal_table(max_len, d).numpy())  # same constants, both sides
    assert_close(table, _seed_sinusoidal(max_len, d), "sinusoidal vs seed formula")
    assert np.allclose(table[0, 0::2], 0) and np.allclose(table[0, 1::2], 1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("shape", [(2, 9, 4, 16), (1, 5, 2, 8)])
@pytest.mark.parametrize("offset", [0, 37])
def test_rope_matches_torch_ref(layout, shape, offset, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    pos = offset + np.arange(shape[1])
    a = P.apply_rope(jnp.asarray(x), pos, base=10000.0, layout=layout)
    b = TP.apply_rope(torch.from_numpy(x), torch.from_numpy(pos), base=10000.0, layout=layout)
    assert_close(a, b, f"RoPE {layout}")
    # Per-batch positions (B, T) give the same result as shared ones.
    a2 = P.apply_rope(jnp.asarray(x), np.broadcast_to(pos, shape[:2]), layout=layout)
    assert_self_consistent(a, a2, f"RoPE {layout}: per-batch vs shared positions")


def test_rope_half_matches_hf_llama(rng):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    b, t, h, d = 2, 11, 3, 16
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    pos = np.arange(5, 5 + t)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.from_numpy(pos).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    qt = torch.from_numpy(q).transpose(1, 2)  # HF is (B, H, T, D)
    ref, _ = apply_rotary_pos_emb(qt, qt, emb.cos()[None], emb.sin()[None])
    assert_close(P.apply_rope(jnp.asarray(q), pos, layout="half"), ref.transpose(1, 2), "RoPE half vs HF LLaMA")


def test_rope_interleaved_matches_seed_complex_form(rng):
    # Seed 000 rotates adjacent pairs as complex numbers: (x0 + i x1) * e^{i p theta}.
    b, t, h, d = 1, 7, 2, 8
    x = rng.standard_normal((b, t, h, d)).astype(np.float32)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cis = torch.polar(torch.ones(t, d // 2), torch.outer(torch.arange(t).float(), freqs))
    xc = torch.view_as_complex(torch.from_numpy(x).transpose(1, 2).reshape(b, h, t, d // 2, 2).contiguous())
    ref = torch.view_as_real(xc * cis[None, None]).reshape(b, h, t, d).transpose(1, 2)
    assert_close(P.apply_rope(jnp.asarray(x), np.arange(t), layout="interleaved"), ref, "RoPE interleaved vs seed")
    # The two layouts are different functions: confusing them would fail parity.
    assert np.abs(np.asarray(P.apply_rope(jnp.asarray(x), np.arange(t), layout="half")) - ref.numpy()).max() > 1e-2


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_dot_product_depends_only_on_offset(layout, rng):
    """Seed 000's check: q.k with RoPE depends on the relative distance only."""
    d = 16
    q = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)
    dots = [float(jnp.sum(P.apply_rope(q, np.array([p]), layout=layout) * P.apply_rope(k, np.array([p + 5]), layout=layout)))
            for p in range(20)]
    assert np.std(dots) < 1e-5
    other = float(jnp.sum(P.apply_rope(q, np.array([0]), layout=layout) * P.apply_rope(k, np.array([9]), layout=layout)))
    assert abs(other - dots[0]) > 1e-3  # a different offset gives a different product


def test_rope_rejects_unknown_layout():
    with pytest.raises(ValueError, match="unknown rope layout 'spiral'"):
        P.apply_rope(jnp.zeros((1, 2, 1, 4)), np.arange(2), layout="spiral")


# One RoPE scaling per variant with an original context of 16 (jaxgpt/config/rope.py; frequencies vs HF's
# functions in test_rope_scaling.py).
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "longrope": dict(rope_type="longrope", factor=4.0, original_max_position_embeddings=32,
                     short_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0], long_factor=[2.0] * 8),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaled_rope_matches_hf_rotary_embedding(name, rng):
    """apply_rope with each scaling vs HF LLaMA's own rotary module (its frequencies, its cos/sin factor,
    its dynamic update) and apply_rotary_pos_emb, at positions past the original context (8..31), and torch_ref."""
    from jaxgpt.config import RopeScaling
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    b, t, h, d = 2, 24, 2, 16
    hf = LlamaConfig(hidden_size=h * d, num_attention_heads=h, max_position_embeddings=32,
                     rope_parameters={**SCALINGS[name], "rope_theta": 10000.0})
    scaling = RopeScaling.from_hf(hf.rope_parameters, hf.max_position_embeddings)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    pos = np.arange(8, 8 + t)
    qt = torch.from_numpy(q).transpose(1, 2)  # HF is (B, H, T, D)
    cos, sin = LlamaRotaryEmbedding(hf)(qt, torch.from_numpy(pos)[None])
    ref, _ = apply_rotary_pos_emb(qt, qt, cos, sin)
    ours = P.apply_rope(jnp.asarray(q), pos, scaling=scaling)
    assert_close(ours, ref.transpose(1, 2), f"RoPE {name} vs HF LLaMA rotary embedding")
    assert_close(ours, TP.apply_rope(torch.from_numpy(q), torch.from_numpy(pos), scaling=scaling), f"RoPE {name}")
    plain = P.apply_rope(jnp.asarray(q), pos)
    assert (np.abs(np.asarray(ours - plain)).max() > 1e-2) == (name != "dynamic")  # the scaling is in effect
