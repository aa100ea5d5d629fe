"""Gemma's features, each against torch_ref (forward and every gradient: float32 at 1e-5 and the float64
twin, conftest.check_module) and, where cheap, transformers' own code: the (1 + w) RMSNorm
(GemmaRMSNorm), the tanh-GELU GeGLU (GemmaMLP), attention with Gemma 2's score multiplier and soft-cap
(Gemma 2's eager_attention_forward) on every kernel that serves it, against 'xla' too (a cache at a
traced offset, a decode step, a paged cache, masks with an empty row), the kernels that lack the cap
refusing it, no C++ attention kernel in a soft-capped model's CPU programs, the sandwich block, the
soft-capped head over a padded vocabulary, and the embedding scale against Gemma's normalizer.

Weights: unit scale (conftest.randomize); a unit-offset norm's stored w is randomize's scale minus 1,
so the gain 1 + w is near 1 as in a trained Gemma."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import assert_close, assert_grads_close, check_module, random_params, require_module
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.models import DecoderLM, build
from jaxgpt.nn import norms
from jaxgpt.nn.block import Block
from jaxgpt.nn.mlp import GeGLU
from jaxgpt.inference.paged_cache import resolve_paged_kernel
from jaxgpt.nn.kernels import attend, paged
from jaxgpt.nn.kernels import causal_ffi, norm_ffi
from torch_ref.models.decoder import DecoderLM as TDecoderLM
from torch_ref.nn import norms as tnorms
from torch_ref.nn.block import Block as TBlock
from torch_ref.nn.mlp import GeGLU as TGeGLU

transformers = require_module("transformers", allow_module_level=True)
SCALE, CAP = 0.3, 1.5  # a multiplier apart from head_dim ** -0.5; a cap the unit-scale scores reach
GEMMA2 = ModelConfig(vocab_size=48, valid_vocab=40, d_model=32, n_head=4, n_kv_head=2, d_head=8, d_ff=48, n_layer=2,
                     max_len=32, pos="rope", norm_unit_offset=True, mlp="geglu_tanh", embed_scale=True,
                     norm_placement="sandwich", attn_scale=SCALE, attn_softcap=CAP, logit_softcap=1.0)


def _unit_offset(params):
    """randomize's norm scales (1 + N(0, 1/4)) as a unit-offset norm's stored w (N(0, 1/4))."""
    return jax.tree_util.tree_map_with_path(lambda p, a: a - 1.0 if p[-1].key == "scale" else a, params)


@pytest.mark.parametrize("impl", ["xla", "ffi"])
def test_unit_offset_rmsnorm_matches_gemma_rmsnorm_and_torch_ref(impl, rng):
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    if impl == "ffi" and norm_ffi.unsupported(jnp.asarray(x)):
        pytest.skip(norm_ffi.unsupported(jnp.asarray(x)))
    ours = norms.RMSNorm(eps=1e-6, unit_offset=True, impl=impl)
    assert not np.asarray(ours.init(jax.random.PRNGKey(0), x)["params"]["scale"]).any()  # stored w starts at 0
    params = {"scale": jnp.asarray(0.5 * rng.standard_normal(32), jnp.float32)}
    check_module(f"RMSNorm unit offset {impl}", ours, tnorms.RMSNorm(32, eps=1e-6, unit_offset=True), [x],
                 params=params)
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hf = GemmaRMSNorm(32, eps=1e-6)
    hf.weight.data = torch.tensor(np.asarray(params["scale"]))
    assert_close(ours.apply({"params": params}, x), hf(torch.from_numpy(x)), "RMSNorm unit offset vs GemmaRMSNorm")


def test_geglu_matches_gemma_mlp_and_torch_ref(rng):
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    p = check_module("GeGLU", GeGLU(16, 24), TGeGLU(16, 24), [x])
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    hf = GemmaMLP(transformers.GemmaConfig(hidden_size=16, intermediate_size=24))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(hf, name).weight.data = torch.from_numpy(np.asarray(p[name]["kernel"]).T.copy())
    assert_close(GeGLU(16, 24).apply({"params": p}, x), hf(torch.from_numpy(x)), "GeGLU vs GemmaMLP")


def _qkv(b, tq, tk, h=4, hk=2, d=8, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((b, tq, h, d), (b, tk, hk, d), (b, tk, hk, d))]


@pytest.mark.parametrize("impl", ["xla", "blocked", "auto"])
def test_softcapped_attention_matches_gemma2_eager_attention(impl):
    """Causal GQA self-attention with query_pre_attn_scalar ** -0.5 and the cap; 'auto' is the C++
    kernel's call on the CPU without a cap (it runs a kernel that has one)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv(2, 10, 10)
    t = lambda a: torch.tensor(np.asarray(a)).transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D)
    neg = torch.where(torch.ones(10, 10, dtype=torch.bool).tril(), 0.0, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(SimpleNamespace(num_key_value_groups=2, training=False), t(q), t(k), t(v),
                                      neg[None, None], scaling=SCALE, softcap=CAP)
    got = attend(q, k, v, impl=impl, block=4, is_causal=True, scale=SCALE, softcap=CAP)
    assert_close(got, want, f"attend {impl} softcap vs Gemma2 eager_attention_forward")


def _cases():
    """(name, q, k, v, attend kwargs) the kernels serve: a train step (several key blocks, a padded last one),
    a prefill over a 'heads' cache at a traced offset with a key mask that empties a row, a decode step over
    a 'rows' cache (where 'auto' would run the C++ cache kernel without the cap)."""
    q, k, v = _qkv(2, 10, 10)
    yield "train", q, k, v, dict(is_causal=True)
    q, k, v = _qkv(2, 5, 12, seed=1)
    mask = np.random.default_rng(2).random((2, 1, 1, 12)) > 0.3
    mask[1] = False
    yield "prefill", q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), dict(
        is_causal=True, q_offset=jnp.int32(4), kv_layout="heads", mask=mask)
    q, k, v = _qkv(2, 1, 12, seed=3)
    rows = lambda a: a.transpose(0, 2, 1, 3).reshape(4, 12, 8)
    yield "decode", q, rows(k), rows(v), dict(is_causal=True, q_offset=jnp.int32(7), kv_layout="rows")


@pytest.mark.parametrize("impl", ["blocked", "auto"])
def test_every_kernel_serving_a_softcap_matches_xla(impl):
    """Forward and the gradients w.r.t. q, k, v against the einsum kernel, each case in _cases."""
    cot = jnp.asarray(np.random.default_rng(9).standard_normal((2, 10, 4, 8)), jnp.float32)
    for name, q, k, v, kw in _cases():
        def f(impl, q, k, v, kw=kw):
            return jnp.sum(attend(q, k, v, impl=impl, block=4, scale=SCALE, softcap=CAP, **kw) * cot[:, :q.shape[1]])

        run = jax.jit(jax.value_and_grad(f, argnums=(1, 2, 3)), static_argnums=0)
        (ref, ref_g), (val, g) = run("xla", q, k, v), run(impl, q, k, v)
        assert_close(val, ref, f"attend {impl} softcap {name}: forward (summed)")
        assert_grads_close(dict(zip("qkv", g)), dict(zip("qkv", ref_g)), f"attend {impl} softcap {name}")


def test_paged_attention_with_a_multiplier_and_a_softcap():
    """kv_layout 'pages' (the engine's 'ffi' cache): with a cap, the pages gathered and a kernel with the cap;
    without one, the C++ paged kernel (on the CPU, where built) with the multiplier."""
    r = np.random.default_rng(4)
    k_pool, v_pool = (jnp.asarray(r.standard_normal((6, 2, 4, 8)), jnp.float32) for _ in range(2))
    table, q_pos = jnp.asarray([[3, 1, 5], [0, 2, 4]]), jnp.asarray([[9], [5]])
    q = _qkv(2, 1, 1, seed=5)[0]
    got = attend(q, k_pool, v_pool, kv_layout="pages", pages=(table, q_pos), scale=SCALE, softcap=CAP)
    k, v, mask = paged.gather(k_pool, v_pool, table, q_pos)
    want = attend(q, k, v, impl="xla", kv_layout="rows", mask=mask, scale=SCALE, softcap=CAP)
    assert_close(got, want, "paged attention softcap vs xla over the gathered pages")
    uncapped = attend(q, k, v, impl="xla", kv_layout="rows", mask=mask, scale=SCALE)
    assert np.abs(np.asarray(want) - np.asarray(uncapped)).max() > 1e-2  # the cap bites
    got = attend(q, k_pool, v_pool, kv_layout="pages", pages=(table, q_pos), scale=SCALE)  # the C++ kernel on the CPU
    assert_close(got, uncapped, "paged attention attn_scale vs xla over the gathered pages")


@pytest.mark.parametrize("impl", ["ffi", "auto"])
def test_attn_scale_reaches_the_cpu_kernels(impl):
    """Gemma 2's multiplier without a cap, where the C++ kernels run (the causal kernel for the train case,
    the cache kernel for the decode step; the others take ``scale`` as jax.nn does), against 'xla'."""
    if impl == "ffi" and not causal_ffi.available():
        pytest.skip("the C++ attention kernel is not built here")
    for name, q, k, v, kw in _cases():
        if name == "prefill" and impl == "ffi":
            continue  # a masked prefill: 'ffi' runs what 'auto' picks, the case below covers it
        want = attend(q, k, v, impl="xla", scale=SCALE, **kw)
        assert np.abs(np.asarray(want) - np.asarray(attend(q, k, v, impl="xla", **kw))).max() > 1e-2
        assert_close(attend(q, k, v, impl=impl, block=4, scale=SCALE, **kw), want, f"attend {impl} attn_scale {name}")


@pytest.mark.parametrize("impl", ["jax", "cudnn", "ffi"])
def test_kernels_without_a_softcap_refuse_it(impl):
    q, k, v = _qkv(1, 4, 4)
    message = rf"attention_impl='{impl}' has no attention soft-capping"
    with pytest.raises(ValueError, match=message):
        attend(q, k, v, impl=impl, is_causal=True, softcap=CAP)
    with pytest.raises(ValueError, match=message):
        build(GEMMA2, Execution(attention_impl=impl))


def test_the_paged_cpu_kernel_refuses_a_softcap():
    with pytest.raises(ValueError, match=r"paged_kernel='ffi' cannot run: it has no attention soft-capping"):
        resolve_paged_kernel("ffi", "float32", np.float32, attn_softcap=CAP)
    with pytest.warns(UserWarning, match="no attention soft-capping"):
        assert resolve_paged_kernel("auto", "float32", np.float32, attn_softcap=CAP) == "gather"


def test_sandwich_block_matches_torch_ref(rng):
    """A Gemma 2 layer: (1 + w) norms before and after each sublayer, GeGLU, the multiplier and the cap."""
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    params = _unit_offset(random_params(Block(GEMMA2), x))
    assert sorted(k for k in params if "norm" in k) == ["attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"]
    check_module("Block sandwich", Block(GEMMA2), TBlock(GEMMA2), [x], params=params, select=lambda o: o[0], jit=True)


def test_softcapped_head_over_a_padded_vocabulary_matches_torch_ref():
    """DecoderLM: logits capped at logit_softcap (reached: uncapped they reach about 4), padded ids still the
    float32 minimum (the float64 twin's is another number: the tokens' logits are compared)."""
    tokens = np.random.default_rng(6).integers(0, 40, (2, 9)).astype(np.int32)
    params = _unit_offset(random_params(DecoderLM(GEMMA2), tokens[:1, :1]))
    check_module("DecoderLM Gemma 2", DecoderLM(GEMMA2), TDecoderLM(GEMMA2), [tokens], params=params,
                 stacked=("layers",), jit=True, select=lambda logits: logits[..., :40])  # the tokens' logits
    logits = np.asarray(DecoderLM(GEMMA2).apply({"params": params}, tokens))
    assert (logits[..., 40:] == np.finfo(np.float32).min).all()
    assert 0.99 < np.abs(logits[..., :40]).max() < 1.0


@pytest.mark.parametrize("d", [2048, 2304, 3072, 3584, 4608])
def test_embed_scale_is_gemmas_normalizer(d):
    """embed_scale multiplies by sqrt(d_model) cast to the compute dtype; Gemma by torch.tensor(d ** 0.5)
    (float32) cast to the weights' dtype: the same number in float32, bfloat16 and float16."""
    for np_dtype, torch_dtype in ((np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16),
                                  (np.float16, torch.float16)):
        ours = float(jnp.asarray(np.sqrt(d), np_dtype))  # jaxgpt.models.stack.embed_tokens
        assert ours == float(torch.tensor(d ** 0.5).to(torch_dtype)), (d, np_dtype)


def test_softcapped_programs_hold_no_cpu_attention_kernel():
    """Where 'auto' and the engine's paged 'ffi' would run a C++ attention kernel (the float32 train step's
    causal kernel, the paged engine step's in-place kernel), a soft-capped model's CPU program holds none;
    its CUDA program lowers too (test_lowering's programs, Gemma 2 sized like LLaMA's there)."""
    from parity_tests.unit.test_lowering import LLAMA, _paged, _train, custom_calls

    gemma2 = LLAMA.replace(**{k: getattr(GEMMA2, k) for k in (
        "norm_unit_offset", "mlp", "embed_scale", "norm_placement", "attn_scale", "attn_softcap", "logit_softcap")})
    for name, traced in (("train", _train(gemma2, "float32")), ("paged", _paged(gemma2))):
        calls = custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text())
        assert not {c for c in calls if "attention" in c}, f"{name}: {sorted(calls)}"
        traced.lower(lowering_platforms=("cuda",))
