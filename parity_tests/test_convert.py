"""The generic torch <-> Flax converter: key rule, bit-exact round trips, strict errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import random_params
from jaxgpt.nn.block import Block
from jaxgpt.config import ModelConfig
from jaxgpt.convert import params_to_state_dict, state_dict_to_params
from torch_ref.nn.block import Block as TBlock
from torch_ref.convert import load_params, module_params

CFG = ModelConfig(d_model=16, n_head=4, n_kv_head=2, norm="layernorm", mlp="gelu", qkv_bias=True, mlp_bias=True)


def _params(cfg=CFG, cross=False):
    x = jnp.zeros((1, 3, cfg.d_model))
    return random_params(Block(cfg, cross=cross), x, x if cross else None)


def test_key_rule_matches_torch_ref_names():
    p = _params(cross=True)
    sd = params_to_state_dict(p)
    assert set(sd) == set(TBlock(CFG, cross=True).state_dict())
    assert np.array_equal(sd["attn.q_proj.weight"], np.asarray(p["attn"]["q_proj"]["kernel"]).T)
    assert np.array_equal(sd["mlp_norm.scale"], np.asarray(p["mlp_norm"]["scale"]))


def test_round_trip_is_bit_exact():
    p = _params(cross=True)
    t = load_params(TBlock(CFG, cross=True), p)
    back = module_params(t, p)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), b)
    sd = t.state_dict()
    sd2 = params_to_state_dict(state_dict_to_params(sd, p))
    assert all(torch.equal(sd[k], torch.from_numpy(sd2[k])) for k in sd)


def test_template_may_be_abstract():
    x = jnp.zeros((1, 3, 16))
    abstract = jax.eval_shape(Block(CFG).init, jax.random.PRNGKey(0), x)["params"]
    t = TBlock(CFG)
    p = module_params(t, abstract)
    assert np.array_equal(p["attn"]["k_proj"]["kernel"], t.attn.k_proj.weight.detach().numpy().T)


def test_errors_name_every_bad_key():
    p = _params()
    sd = params_to_state_dict(p)
    sd.pop("attn.k_proj.bias")
    sd["attn.extra.weight"] = np.zeros(3, np.float32)
    sd["mlp.fc_in.weight"] = np.zeros((5, 16), np.float32)
    with pytest.raises(ValueError) as e:
        state_dict_to_params(sd, p)
    msg = str(e.value)
    assert "missing keys ['attn.k_proj.bias']" in msg
    assert "unexpected keys ['attn.extra.weight']" in msg
    assert "mlp.fc_in.weight: got (5, 16), expected (64, 16)" in msg


def test_torch_side_is_strict_too():
    p = _params()
    p["attn"].pop("q_proj")
    with pytest.raises(RuntimeError, match="q_proj"):
        load_params(TBlock(CFG), p)


def test_stacked_layers_map_to_indexed_keys():
    # nn.scan stacks each layer's leaf on a leading axis; torch keeps layers.{i}.
    layer = _params()
    stacked = {"layers": jax.tree.map(lambda a: jnp.stack([a, a + 1.0, a + 2.0]), layer), "norm": {"scale": jnp.ones(4)}}
    sd = params_to_state_dict(stacked, stacked=("layers",))
    assert "layers.2.attn.q_proj.weight" in sd and "norm.scale" in sd
    assert np.array_equal(sd["layers.1.mlp.fc_out.bias"], np.asarray(layer["mlp"]["fc_out"]["bias"]) + 1.0)
    back = state_dict_to_params(sd, stacked, stacked=("layers",))
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), b)


def test_indexed_module_names():
    tree = {"layers_0": {"fc": {"kernel": np.ones((2, 3), np.float32)}}, "embed": {"embedding": np.ones((5, 2), np.float32)}}
    sd = params_to_state_dict(tree)
    assert sd["layers.0.fc.weight"].shape == (3, 2) and sd["embed.weight"].shape == (5, 2)
