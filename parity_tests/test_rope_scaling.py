"""RoPE scaling variants (ModelConfig.rope_scaling): the frequencies and the cos/sin factor of each
variant vs transformers' own ``ROPE_INIT_FUNCTIONS``, the config's round trips and refusals, and whole
HF LLaMA models with llama3 (Llama 3.x: tied, 1B/3B-style), linear and yarn scaling through
``hf_family.check_family`` (load, export, parity with gradients, generate and the engine vs HF's tokens)."""
import json

import numpy as np
import pytest

from parity_tests.hf_family import check_family, perturb
from jaxgpt.config import ModelConfig, RopeScaling, config_from_dict
from jaxgpt.nn.positions import rope_frequencies
from torch_ref.nn.positions import rope_frequencies as torch_rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 32
_SHORT, _LONG = list(np.linspace(1.0, 2.0, HEAD_DIM // 2)), list(np.linspace(1.0, 9.0, HEAD_DIM // 2))
# HF parameter dicts, one or two per variant; small original contexts put frequencies in every band.
VARIANTS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16),
    "yarn-mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=16,
                        beta_slow=2, mscale=1.2, mscale_all_dim=0.8, truncate=False),
    "yarn-defaults": dict(rope_type="yarn", factor=4.0),  # HF fills original_max_position_embeddings in
    "yarn-attention": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, attention_factor=0.9),
    "llama3": dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "llama3-small": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=16),
    "longrope": dict(rope_type="longrope", factor=4.0, original_max_position_embeddings=16, short_factor=_SHORT,
                     long_factor=_LONG),
}


def _hf_config(params, theta, max_pos=64):
    return transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=max_pos,
                                    rope_parameters={**params, "rope_theta": theta})


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_frequencies_match_hf_rope_init_functions(name, theta):
    """HF computes in float32, jaxgpt in float64 rounded once: within 4 float32 ulps (5e-7 relative);
    the cos/sin factor to 1e-12; jaxgpt and torch_ref bit-identical."""
    hf = _hf_config(dict(VARIANTS[name]), theta)
    scaling = RopeScaling.from_hf(hf.rope_parameters, hf.max_position_embeddings)
    assert RopeScaling.from_hf(VARIANTS[name], hf.max_position_embeddings) == scaling  # config.json as written
    want, want_attn = ROPE_INIT_FUNCTIONS[scaling.rope_type](hf, "cpu")
    inv, attn = rope_frequencies(HEAD_DIM, theta, scaling)
    assert inv.dtype == np.float32 and inv.shape == (HEAD_DIM // 2,)
    np.testing.assert_allclose(inv, want.numpy(), rtol=5e-7, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-12)
    t_inv, t_attn = torch_rope_frequencies(HEAD_DIM, theta, scaling)
    assert np.array_equal(inv, t_inv.numpy()) and attn == t_attn
    if scaling.rope_type == "longrope":  # HF's set past the original context
        want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=17)
        np.testing.assert_allclose(rope_frequencies(HEAD_DIM, theta, scaling, long=True)[0], want_long.numpy(),
                                   rtol=5e-7, atol=0)
    if scaling.rope_type == "dynamic":  # within max_position_embeddings HF keeps plain RoPE's
        within, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=hf.max_position_embeddings)
        np.testing.assert_allclose(inv, within.numpy(), rtol=5e-7, atol=0)


def test_scaling_changes_the_frequencies():
    """Each variant moves some frequency off plain RoPE's (a test of the tests above)."""
    plain, _ = rope_frequencies(HEAD_DIM, 10000.0)
    for name, params in VARIANTS.items():
        scaling = RopeScaling.from_hf(params, 64)
        inv, attn = rope_frequencies(HEAD_DIM, 10000.0, scaling)
        assert (np.abs(inv / plain - 1).max() > 1e-3 or attn != 1.0) == (name != "dynamic"), name


def test_config_round_trips_through_dict_and_json():
    """As checkpoints and safetensors metadata store it (config_from_dict of the JSON), and HF's dict."""
    for params in VARIANTS.values():
        scaling = RopeScaling.from_hf(params, 64)
        config = ModelConfig(pos="rope", d_model=128, max_len=16, rope_scaling=scaling)
        assert config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
        assert RopeScaling.from_hf(scaling.to_hf(1e4), 64) == scaling


@pytest.mark.parametrize("kw,message", [
    (dict(rope_type="yarn", factor=2.0), r"rope_scaling 'yarn' needs \['original_max_position_embeddings'\]"),
    (dict(rope_type="linear", factor=0.5), r"factor must be >= 1"),
    (dict(rope_type="linear", factor=2.0, beta_fast=8.0), r"'linear' does not use \['beta_fast'\]"),
    (dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=4.0,
          high_freq_factor=1.0), r"0 < low_freq_factor < high_freq_factor"),
    (dict(rope_type="ntk"), r"rope_type='ntk' is not one of"),
])
def test_bad_values_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=message) as err:
        RopeScaling(**kw)
    assert "\n" not in str(err.value)


def test_model_level_refusals_name_why():
    longrope = RopeScaling.from_hf(VARIANTS["longrope"], 64)
    with pytest.raises(ValueError, match=r"max_len=64 exceeds original_max_position_embeddings=16; past it HF switches"):
        ModelConfig(pos="rope", d_model=128, n_head=4, max_len=64, rope_scaling=longrope)
    with pytest.raises(ValueError, match=r"need head_dim // 2 = 8 values, got 16"):
        ModelConfig(pos="rope", d_model=64, n_head=4, max_len=16, rope_scaling=longrope)
    with pytest.raises(ValueError, match=r"needs pos='rope'"):
        ModelConfig(pos="learned", rope_scaling=RopeScaling("linear", factor=2.0))


_LLAMA = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
# Original contexts of 16 under sequences of 24 and prompts of 19 + 8 tokens.
FAMILIES = {
    "llama3": dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16, rope_theta=500000.0)),
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    "yarn": dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                      rope_theta=100.0)),  # a small theta: the yarn ramp spans dimensions 0-2
}


# llama3 in the default tier; linear and yarn (~5 s each) in the slow one.
@pytest.mark.parametrize("name", ["llama3", pytest.param("linear", marks=pytest.mark.slow),
                                  pytest.param("yarn", marks=pytest.mark.slow)])
def test_scaled_llama_everywhere(name, tmp_path):
    hf = perturb(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA, **FAMILIES[name])))
    config, _ = check_family(hf, tmp_path, f"LLaMA rope {name}")
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == name
    assert config.tie_embeddings == (name == "llama3")


# Meta's config.json values for Llama 3.1 / 3.2 (hidden, layers, heads, intermediate, rope factor, tied)
# and the parameter counts their model cards give.
_META = {"llama3.2-1b": (2048, 16, 32, 8192, 32.0, True, 1_235_814_400),
         "llama3.2-3b": (3072, 28, 24, 8192, 32.0, True, 3_212_749_824),
         "llama3.1-8b": (4096, 32, 32, 14336, 8.0, False, 8_030_261_248)}


@pytest.mark.parametrize("name", sorted(_META))
def test_llama3_presets_are_metas_configs(name):
    import jax

    from jaxgpt.config import PRESETS
    from jaxgpt.convert import llama
    from jaxgpt.models import abstract_params

    hidden, layers, heads, inter, factor, tied, count = _META[name]
    hf = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=8, intermediate_size=inter, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, bos_token_id=128000, eos_token_id=128001, rope_parameters=dict(
            rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192, rope_theta=500000.0))
    assert llama.config_from_hf(hf.to_dict(), "LlamaForCausalLM") == PRESETS[name]
    assert transformers.LlamaConfig(**llama.config_to_hf(PRESETS[name])).rope_parameters == hf.rope_parameters
    assert sum(x.size for x in jax.tree.leaves(abstract_params(PRESETS[name]))) == count
