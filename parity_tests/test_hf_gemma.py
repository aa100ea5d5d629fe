"""HF Gemma, Gemma 2 and Gemma 3 text (issue 53): ``hf_family.check_family`` on one tiny model of each, built from
transformers' config classes (random weights perturbed to unit scale, eager attention).

Gemma 2's model has every Gemma 2 feature on: (1 + w) norms, a norm before and after each sublayer,
query_pre_attn_scalar apart from head_dim, both soft-caps set low enough to bite (logits reach the
caps), alternating sliding/full layer types with a window (8) shorter than the prompts, and an untied head
(the other model ties it). Gemma 3's adds (1 + w) q/k norms and a sliding-layer RoPE base apart from the
global layers' (which are scaled, linear). The presets are checked against the published config.json files."""
import pytest

from conftest import require_module
from parity_tests.hf_family import check_family, perturb
from jaxgpt.nn.kernels import panel_ffi

transformers = require_module("transformers", allow_module_level=True)
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=32, attn_implementation="eager")


@pytest.mark.slow  # Gemma 2's model below runs each Gemma feature too; this adds the pre-norm layout and a tied head
def test_gemma_everywhere(tmp_path):
    hf = perturb(transformers.GemmaForCausalLM(transformers.GemmaConfig(**SIZES)))
    config, _ = check_family(hf, tmp_path, "Gemma")
    assert config.norm_unit_offset and config.embed_scale and config.mlp == "geglu_tanh"
    assert config.tie_embeddings and config.norm_placement == "pre"


def test_gemma2_everywhere(tmp_path):
    hf = perturb(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SIZES, query_pre_attn_scalar=12, attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
        sliding_window=8, tie_word_embeddings=False)))
    # the packed head caps its logits too; the pages are gathered ('auto' would say so in a warning)
    engine = dict(paged_kernel="gather", **(dict(head_kernel="panel") if panel_ffi.available() else {}))
    config, _ = check_family(hf, tmp_path, "Gemma 2", engine_kw=engine)
    assert config.norm_placement == "sandwich" and config.attn_scale == 12 ** -0.5
    assert (config.attn_softcap, config.logit_softcap) == (1.5, 3.0)
    assert (config.sliding_window, config.window_layers) == (8, (0,))


def test_gemma2_window_round_trips():
    """A window covering the context masks nothing (None); exported layer kinds are the config's."""
    from jaxgpt.convert import gemma

    d = {**SIZES, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 3}
    d.pop("attn_implementation")
    config = gemma.config_from_hf({**d, "sliding_window": 8}, "Gemma2ForCausalLM")
    assert (config.sliding_window, config.window_layers) == (8, (0, 2))
    assert gemma.config_from_hf({**d, "sliding_window": 32}, "Gemma2ForCausalLM").sliding_window is None
    out = gemma.config_to_hf(config)
    assert out["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma.config_from_hf(out, "Gemma2ForCausalLM") == config


@pytest.mark.slow  # the Gemma 2 model above runs the shared Gemma numerics; this adds q/k norms and two RoPE bases
def test_gemma3_everywhere(tmp_path):
    hf = perturb(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SIZES, query_pre_attn_scalar=12, sliding_window=8, sliding_window_pattern=2, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})))
    config, _ = check_family(hf, tmp_path, "Gemma 3", engine_kw=dict(paged_kernel="gather"))
    assert config.qk_norm == "head" and (config.rope_base, config.rope_local_base) == (1e5, 100.0)
    assert (config.sliding_window, config.window_layers, config.rope_scaling.factor) == (8, (0,), 4.0)


# config.json of google/gemma-2b, google/gemma-2-2b and google/gemma-3-1b-pt (as published; weights not needed)
HUB = {
    "gemma-2b": dict(architectures=["GemmaForCausalLM"], model_type="gemma", attention_bias=False,
                     attention_dropout=0.0, bos_token_id=2, eos_token_id=1, pad_token_id=0, head_dim=256,
                     hidden_act="gelu", hidden_size=2048, initializer_range=0.02, intermediate_size=16384,
                     max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=18,
                     num_key_value_heads=1, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=10000.0,
                     torch_dtype="bfloat16", use_cache=True, vocab_size=256000),
    "gemma2-2b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attention_bias=False,
                      attention_dropout=0.0, attn_logit_softcapping=50.0, bos_token_id=2, cache_implementation="hybrid",
                      eos_token_id=[1, 107], final_logit_softcapping=30.0, head_dim=256,
                      hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=2304,
                      initializer_range=0.02, intermediate_size=9216, max_position_embeddings=8192,
                      num_attention_heads=8, num_hidden_layers=26, num_key_value_heads=4, pad_token_id=0,
                      query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                      torch_dtype="float32", use_cache=True, vocab_size=256000),
    "gemma3-1b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
                      attention_dropout=0.0, attn_logit_softcapping=None, bos_token_id=2, cache_implementation="hybrid",
                      eos_token_id=1, final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                      hidden_size=1152, initializer_range=0.02, intermediate_size=6912, max_position_embeddings=32768,
                      num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1, pad_token_id=0,
                      query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None,
                      rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, torch_dtype="bfloat16",
                      use_cache=True, vocab_size=262144),
}


@pytest.mark.parametrize("name", sorted(HUB))
def test_presets_are_the_published_configs(name):
    """The presets' shapes (and Gemma 2's alternating 4,096-token window) are the published models'."""
    from jaxgpt import PRESETS
    from jaxgpt.convert import gemma

    d = HUB[name]
    config, preset = gemma.config_from_hf(d, d["architectures"][0]), PRESETS[name]
    assert config.replace(d_head=config.head_dim) == preset.replace(d_head=preset.head_dim)
