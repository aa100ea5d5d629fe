"""ModelConfig validation and derived sizes."""
import dataclasses

import pytest

from jaxgpt.config import ModelConfig


@pytest.mark.parametrize("kwargs,message", [
    (dict(d_model=30, n_head=4), "d_model=30 is not divisible by n_head=4"),
    (dict(n_head=4, n_kv_head=3), "n_head=4 is not divisible by n_kv_head=3"),
    (dict(pos="alibi"), "pos='alibi' is not one of"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not one of"),
    (dict(mlp="geglu"), "mlp='geglu' is not one of"),
    (dict(norm_placement="sandwich"), "norm_placement='sandwich' is not one of"),
    (dict(rope_layout="spiral"), "rope_layout='spiral'"),
    (dict(vocab_size=0), "vocab_size must be a positive int, got 0"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    (dict(norm_eps=0.0), "norm_eps must be > 0"),
    (dict(d_model=36, n_head=12, pos="rope"), "RoPE needs an even head_dim, got 3"),
])
def test_invalid_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_frozen_and_derived():
    cfg = ModelConfig(d_model=64, n_head=8, n_kv_head=2, n_layer=6, scale_out_init=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 32
    assert cfg.head_dim == 8 and cfg.kv_heads == 2
    assert abs(cfg.out_init_std - 0.02 / 12 ** 0.5) < 1e-12
    assert ModelConfig(n_head=4).kv_heads == 4
    assert cfg.replace(d_ff=100).ffn_dim == 100
    with pytest.raises(ValueError, match="not divisible"):
        cfg.replace(n_head=5)


def test_dict_round_trip():
    cfg = ModelConfig(pos="rope", n_kv_head=2)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields: \['n_embd'\]"):
        ModelConfig.from_dict({"n_embd": 3})
