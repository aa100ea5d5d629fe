"""Block: Pre-LN and Post-LN, every norm and FFN kind, optional cross-attention, vs torch_ref."""
import jax
import numpy as np
import pytest
import torch

from conftest import assert_close, check_module, load_into, random_params
from jaxgpt.nn.block import Block
from jaxgpt.config import ModelConfig
from jaxgpt.core.layout import params_to_state_dict, state_dict_to_params, to_numpy
from torch_ref.nn.block import Block as TBlock
from torch_ref.convert import module_params


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm,mlp,pos", [("rmsnorm", "swiglu", "rope"), ("layernorm", "gelu_tanh", "learned"),
                                          ("layernorm", "relu", "none"), ("rmsnorm", "gelu", "rope")])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_block_matches_torch_ref(placement, norm, mlp, pos, n_kv_head, rng):
    """Forward and every gradient vs torch_ref in float32 (1e-5) and in float64 (conftest.check_module).
    Pre-LN gradients: float64 only; their float32-vs-float32 error reached 7.6e-6 over 20 weight draws
    (docs/parity-margins.md), too near 1e-5 to hold on every CPU."""
    cfg = ModelConfig(d_model=32, n_head=4, n_kv_head=n_kv_head, norm=norm, mlp=mlp, pos=pos,
                      norm_placement=placement, qkv_bias=norm == "layernorm", mlp_bias=norm == "layernorm")
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    check_module(f"Block {placement}-LN", Block(cfg), TBlock(cfg), [x], select=lambda o: o[0],
                 direct_grads=placement != "pre")


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_with_cross_attention_matches_torch_ref(placement, rng):
    cfg = ModelConfig(d_model=32, n_head=4, norm="layernorm", mlp="relu", norm_placement=placement,
                      qkv_bias=True, o_bias=True, mlp_bias=True, pos="sinusoidal")
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    ctx = rng.standard_normal((2, 8, 32)).astype(np.float32)
    cmask = np.ones((2, 1, 1, 8), bool)
    cmask[0, ..., 5:] = False
    check_module("Block cross", Block(cfg, cross=True), TBlock(cfg, cross=True), [x, ctx],
                 jax_kwargs=dict(context_mask=cmask), torch_kwargs=dict(context_mask=torch.from_numpy(cmask)),
                 select=lambda o: o[0])


def test_pre_and_post_ln_differ(rng):
    x = rng.standard_normal((1, 4, 16)).astype(np.float32)
    pre, post = ModelConfig(d_model=16, n_head=2), ModelConfig(d_model=16, n_head=2, norm_placement="post")
    p = random_params(Block(pre), x)
    a = np.asarray(Block(pre).apply({"params": p}, x)[0])
    b = np.asarray(Block(post).apply({"params": p}, x)[0])
    assert np.abs(a - b).max() > 1e-2
    # Post-LN ends in a norm: the output rows are normalised (RMS = scale's RMS-weighted 1).
    tb = load_into(TBlock(post), p)
    assert_close(b, tb(torch.from_numpy(x))[0], "Block post-LN forward")


def test_block_dropout_is_a_function_of_the_rng(rng):
    cfg = ModelConfig(d_model=16, n_head=2, dropout=0.3)
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    blk = Block(cfg)
    p = blk.init(jax.random.PRNGKey(0), x)["params"]
    run = lambda k: np.asarray(blk.apply({"params": p}, x, deterministic=False, rngs={"dropout": k})[0])
    assert np.array_equal(run(jax.random.PRNGKey(3)), run(jax.random.PRNGKey(3)))
    assert not np.array_equal(run(jax.random.PRNGKey(3)), run(jax.random.PRNGKey(4)))
    assert np.array_equal(np.asarray(blk.apply({"params": p}, x)[0]), np.asarray(blk.apply({"params": p}, x)[0]))


def test_cross_block_requires_context(rng):
    cfg = ModelConfig(d_model=16, n_head=2)
    with pytest.raises(ValueError, match="pass context"):
        Block(cfg, cross=True).init(jax.random.PRNGKey(0), np.zeros((1, 2, 16), np.float32))
    with pytest.raises(ValueError, match="pass context"):
        TBlock(cfg, cross=True)(torch.zeros(1, 2, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_torch_weights_upcast_exactly(dtype):
    """A torch_ref Block in bf16/fp16 -> state dict -> params: exactly the float32 upcast of its
    weights (bf16 tensors have no .numpy(); the converter upcasts explicitly, which is exact)."""
    cfg = ModelConfig(d_model=16, n_head=2, n_kv_head=1, norm="layernorm", mlp="gelu", qkv_bias=True)
    x = np.zeros((1, 3, 16), np.float32)
    template = random_params(Block(cfg), x)
    tb = load_into(TBlock(cfg), template).to(dtype)
    sd = tb.state_dict()
    want = {k: v.float().numpy() for k, v in sd.items()}  # torch's own upcast, the reference
    assert not all(np.array_equal(want[k], v) for k, v in params_to_state_dict(template).items())  # rounded
    for params in (state_dict_to_params(sd, template), module_params(tb, template)):
        got = params_to_state_dict(params)
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), k
    # NumPy float16 and ml_dtypes bfloat16 arrays are upcast the same way.
    half = {k: (v.numpy() if dtype == torch.float16 else np.asarray(jax.numpy.asarray(v.float().numpy(),
                                                                                     jax.numpy.bfloat16)))
            for k, v in sd.items()}
    assert {a.dtype.name for a in half.values()} == {"float16" if dtype == torch.float16 else "bfloat16"}
    got = params_to_state_dict(state_dict_to_params(half, template))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert {to_numpy(v).dtype for v in (*sd.values(), *half.values())} == {np.dtype(np.float32)}
    halved = jax.tree.map(lambda a: a.astype(next(iter(half.values())).dtype), template)  # half-precision params
    assert all(v.dtype == np.float32 for v in params_to_state_dict(halved).values())
