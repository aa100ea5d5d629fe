"""Feed-forward networks: MLP (relu/gelu/gelu_tanh) and SwiGLU vs torch_ref and nn.GELU, and the
seed's parameter counts (SwiGLU 3 d d_ff vs ReLU 2 d d_ff + biases)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import assert_close, check_module
from jaxgpt.config import ModelConfig
from jaxgpt.nn.mlp import ACTIVATIONS, MLP, SwiGLU, make_mlp
from torch_ref.nn import mlp as tmlp


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 24)])
def test_mlp_matches_torch_ref(activation, use_bias, shape, rng):
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    check_module(f"MLP {activation}", MLP(d, 4 * d, activation, use_bias), tmlp.MLP(d, 4 * d, activation, use_bias), [x])


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 16), (1, 3, 40)])
def test_swiglu_matches_torch_ref(use_bias, shape, rng):
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    check_module("SwiGLU", SwiGLU(d, 3 * d, use_bias), tmlp.SwiGLU(d, 3 * d, use_bias), [x])


@pytest.mark.parametrize("name,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
def test_gelu_matches_nn_gelu(name, approximate):
    x = np.linspace(-6, 6, 1001, dtype=np.float32)
    ref = torch.nn.GELU(approximate=approximate)(torch.from_numpy(x))
    assert_close(ACTIVATIONS[name](jnp.asarray(x)), ref, f"GELU {approximate} vs nn.GELU")


def test_gelu_approximations_differ():
    # jax.nn.gelu defaults to tanh; torch's nn.GELU to erf. Mixing them up exceeds 1e-5.
    x = jnp.linspace(-3, 3, 101)
    assert float(jnp.max(jnp.abs(ACTIVATIONS["gelu"](x) - ACTIVATIONS["gelu_tanh"](x)))) > 1e-4


def _count(module, d):
    p = module.init(jax.random.PRNGKey(0), jnp.zeros((1, d)))["params"]
    return sum(x.size for x in jax.tree.leaves(p))


def test_parameter_counts_match_seed():
    d, d_ff = 64, 256
    assert _count(SwiGLU(d, d_ff), d) == 3 * d * d_ff == 49152
    assert _count(MLP(d, d_ff, "relu", use_bias=True), d) == 2 * d * d_ff + d_ff + d == 33088
    assert sum(p.numel() for p in tmlp.SwiGLU(d, d_ff).parameters()) == 3 * d * d_ff
    assert sum(p.numel() for p in tmlp.MLP(d, d_ff, "relu").parameters()) == 2 * d * d_ff + d_ff + d


def test_make_mlp_and_default_widths():
    cfg = ModelConfig(d_model=64, mlp="swiglu")
    assert cfg.ffn_dim == 176 and isinstance(make_mlp(cfg), SwiGLU)  # 2/3 of 4*64, rounded up to 8
    cfg = ModelConfig(d_model=64, mlp="gelu_tanh", mlp_bias=True)
    assert cfg.ffn_dim == 256 and make_mlp(cfg).activation == "gelu_tanh"
    assert isinstance(tmlp.make_mlp(cfg), tmlp.MLP)


def test_unknown_activation_is_an_error():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        MLP(8, 16, "swish").init(jax.random.PRNGKey(0), jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        tmlp.MLP(8, 16, "swish")
