"""Norms: jaxgpt vs torch_ref vs torch built-ins (nn.LayerNorm, nn.RMSNorm)."""
import numpy as np
import pytest
import torch

from conftest import assert_close, check_module, random_params
from jaxgpt.nn import norms
from jaxgpt.config import FLOAT32_EPS
from torch_ref.nn import norms as tnorms

SHAPES = [(2, 5, 16), (3, 64), (1, 7, 48)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("use_bias", [True, False])
def test_layernorm_matches_torch_ref(shape, eps, use_bias, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    check_module("LayerNorm", norms.LayerNorm(eps=eps, use_bias=use_bias),
                 tnorms.LayerNorm(shape[-1], eps=eps, use_bias=use_bias), [x])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, FLOAT32_EPS])
def test_rmsnorm_matches_torch_ref(shape, eps, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    check_module("RMSNorm", norms.RMSNorm(eps=eps), tnorms.RMSNorm(shape[-1], eps=eps), [x])


def _into_builtin(builtin, params):
    with torch.no_grad():
        builtin.weight.copy_(torch.tensor(np.asarray(params["scale"])))
        if "bias" in params:
            builtin.bias.copy_(torch.tensor(np.asarray(params["bias"])))
    return builtin


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_layernorm_matches_nn_layernorm(eps, rng):
    # A large mean on purpose: one-pass (fast) variance would lose digits here.
    x = (rng.standard_normal((4, 9, 32)) + 30.0).astype(np.float32)
    mod = norms.LayerNorm(eps=eps)
    params = random_params(mod, x)
    ref = _into_builtin(torch.nn.LayerNorm(32, eps=eps), params)
    assert_close(mod.apply({"params": params}, x), ref(torch.from_numpy(x)), "LayerNorm vs nn.LayerNorm")


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rmsnorm_matches_nn_rmsnorm(eps, rng):
    x = rng.standard_normal((4, 9, 32)).astype(np.float32)
    # nn.RMSNorm(eps=None) means float32 machine epsilon: the value seed 002 depends on.
    mod = norms.RMSNorm(eps=FLOAT32_EPS if eps is None else eps)
    params = random_params(mod, x)
    ref = _into_builtin(torch.nn.RMSNorm(32, eps=eps), params)
    assert_close(mod.apply({"params": params}, x), ref(torch.from_numpy(x)), "RMSNorm vs nn.RMSNorm")


def test_eps_is_honoured():
    # Variance ~3e-7 next to eps 1e-5: the wrong eps (Flax's default 1e-6) is off by far more than 1e-5.
    x = np.linspace(-1e-3, 1e-3, 8, dtype=np.float32)[None]
    ones = {"params": {"scale": np.ones(8, np.float32), "bias": np.zeros(8, np.float32)}}
    ref = torch.nn.LayerNorm(8, eps=1e-5)(torch.from_numpy(x))
    assert_close(norms.LayerNorm(eps=1e-5).apply(ones, x), ref, "LayerNorm vs nn.LayerNorm")
    assert np.abs(np.asarray(norms.LayerNorm(eps=1e-6).apply(ones, x)) - ref.detach().numpy()).max() > 1e-2


def test_make_norm_rejects_unknown():
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        norms.make_norm("batchnorm", 1e-5)
    with pytest.raises(ValueError, match="unknown norm"):
        tnorms.make_norm("batchnorm", 8, 1e-5)
