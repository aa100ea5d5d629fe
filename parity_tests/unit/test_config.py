"""Config validation (the type of every field of every config, ranges) and derived sizes."""
import dataclasses
import re

import pytest

from jaxgpt.config import ModelConfig


@pytest.mark.parametrize("kwargs,message", [
    (dict(d_model=30, n_head=4), "d_model=30 is not divisible by n_head=4"),
    (dict(n_head=4, n_kv_head=3), "n_head=4 is not divisible by n_kv_head=3"),
    (dict(pos="alibi"), "pos='alibi' is not one of"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not one of"),
    (dict(mlp="geglu"), "mlp='geglu' is not one of"),
    (dict(norm_placement="sideways"), "norm_placement='sideways' is not one of"),
    (dict(attn_softcap=0.0), r"attn_softcap must be > 0 or None, got 0.0"),
    (dict(logit_softcap=-30.0), r"logit_softcap must be > 0 or None, got -30.0"),
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


# --- types: every field of every config, from its annotation -------------------------------------

from jaxgpt.config import BertConfig, EncDecConfig, TrainConfig  # noqa: E402 - after the setup above, which must run first

_BASES = {ModelConfig: ModelConfig(), TrainConfig: TrainConfig(), BertConfig: BertConfig(ModelConfig(pos="learned")),
          EncDecConfig: EncDecConfig(ModelConfig(), ModelConfig())}


def _wrong_values(allowed: tuple) -> list:
    """Values of the wrong type for a field allowing ``allowed``: strings for numbers, bools for
    ints (bool subclasses int), ints for bools and strings, fractions for ints, dicts for configs."""
    out = []
    if str not in allowed:
        out.append("abc")
    if int in allowed or float in allowed:
        out.append(True)
    if int in allowed:
        out.append(1.5)
    if (bool in allowed or str in allowed) and int not in allowed:  # int | str ('auto' or a count) takes 1
        out.append(1)
    if ModelConfig in allowed:
        out.append({"d_model": 64})
    return out


_CASES = [(cls, name, bad) for cls in _BASES for name, allowed in cls.field_types().items()
          for bad in _wrong_values(allowed)]


@pytest.mark.parametrize("cls, name, bad", _CASES, ids=[f"{c.__name__}.{n}={b!r}" for c, n, b in _CASES])
def test_every_field_rejects_a_wrong_type(cls, name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be .+, got {re.escape(repr(bad))} \({type(bad).__name__}\)$"):
        dataclasses.replace(_BASES[cls], **{name: bad})


def test_every_field_is_covered():
    names = {(c, n) for c, n, _ in _CASES}
    assert names == {(c, f.name) for c in _BASES for f in dataclasses.fields(c)}


def test_numbers_are_normalised_and_must_be_finite():
    import numpy as np

    tc = TrainConfig(lr=1, grad_clip=2, steps=np.int64(7))  # ints for floats, NumPy ints for ints
    assert (tc.lr, tc.grad_clip, tc.steps) == (1.0, 2.0, 7)
    assert type(tc.lr) is float and type(tc.steps) is int
    assert type(ModelConfig(rope_base=500000).rope_base) is float
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"^lr must be a finite number, got {bad}$"):
            TrainConfig(lr=bad)
    with pytest.raises(ValueError, match=r"^n_kv_head must be an int or None, got '2' \(str\)$"):
        ModelConfig(n_kv_head="2")
    with pytest.raises(ValueError, match=r"^on_nonfinite='ignore' is not one of \('stop', 'skip'\)$"):
        TrainConfig(on_nonfinite="ignore")
