"""Issue 53's newer HF families, each checked everywhere LLaMA runs (parity_tests/hf_family.py:
load_hf, save_hf back into transformers, parity --grads, generate and the paged engine against
transformers' greedy tokens): Qwen3 (q/k RMSNorm per head), OLMo 2 (q/k RMSNorm over the projection,
norms after each sublayer), GPT-NeoX / Pythia (fused per-head q/k/v, partial rotary, parallel
residual, LayerNorm with biases) and Phi-3 (fused qkv_proj and gate_up_proj)."""
import numpy as np
import pytest
from safetensors import safe_open

from conftest import assert_close, require_module
from parity_tests.hf_family import check_family, hf_logits, perturb
from jaxgpt import build
from jaxgpt.convert import from_hf, gpt_neox, llama, load_hf, olmo2, phi3, qwen3, save_hf, to_hf

transformers = require_module("transformers", allow_module_level=True)  # CI=true: missing is a failure
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, attn_implementation="eager")


@pytest.mark.slow
def test_qwen3(tmp_path):
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16,
                                                                attention_bias=True))
    config, _ = check_family(perturb(hf), tmp_path, "Qwen3")
    assert config.qk_norm == "head" and config.head_dim == 16 and config.kv_heads == 2 and config.o_bias


@pytest.mark.slow
def test_olmo2(tmp_path):
    hf = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SIZES, num_key_value_heads=2, pad_token_id=0))
    config, _ = check_family(perturb(hf), tmp_path, "OLMo 2")
    assert config.qk_norm == "full" and config.norm_placement == "post_sublayer" and config.pad_token_id == 0


def _neox(parallel: bool, **kw):
    return perturb(transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **SIZES, rotary_pct=0.5, rotary_emb_base=1000.0, use_parallel_residual=parallel, **kw)))


@pytest.mark.slow
def test_gpt_neox(tmp_path):
    config, _ = check_family(_neox(parallel=True), tmp_path, "GPT-NeoX")
    assert config.rotary_dim == 4 and config.parallel_residual and config.rope_base == 1000.0


def test_gpt_neox_sequential_residual(tmp_path):
    """use_parallel_residual=False (with no attention biases and a tied head): load_hf's logits and save_hf's
    weights, bit for bit (the rest of the path is test_gpt_neox's)."""
    hf = _neox(parallel=False, attention_bias=False, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    assert not config.parallel_residual and not config.qkv_bias and config.tie_embeddings
    ids = np.random.default_rng(0).integers(0, 64, (2, 11))
    assert_close(build(config).apply({"params": params}, ids), hf_logits(hf, ids), "load_hf GPT-NeoX sequential")
    save_hf(tmp_path / "ours", config, params)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "ours" / "model.safetensors"), "np") as b:
        assert set(a.keys()) == set(b.keys()) and all(np.array_equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


@pytest.mark.slow
def test_phi3(tmp_path):
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SIZES, num_key_value_heads=2, pad_token_id=0, rope_parameters={
            "rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}))
    config, _ = check_family(perturb(hf), tmp_path, "Phi3")
    assert config.rotary_dim == 4 and config.kv_heads == 2 and config.rope_base == 1000.0


def _models():
    """One tiny transformers model per family (random weights, unit scale)."""
    kv = dict(num_key_value_heads=2)
    return {"Qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, **kv, head_dim=16)),
            "OLMo2": transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SIZES, **kv, pad_token_id=0)),
            "GPT-NeoX": _neox(parallel=True),
            "Phi3": transformers.Phi3ForCausalLM(transformers.Phi3Config(
                **SIZES, **kv, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.5}))}


def test_live_models_round_trip_bit_for_bit():
    """from_hf of a live model, then to_hf: the same state dict, bit for bit (fused tensors re-fused)."""
    import torch

    for name, hf in _models().items():
        config, params = from_hf(perturb(hf))
        back = to_hf(config, params)
        assert type(back) is type(hf), name
        want, got = hf.state_dict(), back.state_dict()
        assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), name


PRESETS_OF = {"qwen3-0.6b": qwen3, "olmo2-1b": olmo2, "pythia-160m": gpt_neox, "phi3-mini": phi3}


@pytest.mark.parametrize("name", sorted(PRESETS_OF))
def test_presets_have_the_checkpoints_shapes(name):
    """Each preset's HF config builds (on the meta device, no memory) an HF model of its family with exactly
    the preset's parameter count; save_hf picks that family (phi3-mini's full rotary exports as LLaMA)."""
    import torch

    from jaxgpt import PRESETS
    from jaxgpt.convert.hf import _family_of
    from jaxgpt.models import abstract_params, count_params

    config, family = PRESETS[name], PRESETS_OF[name]
    assert _family_of(config) is (llama if family is phi3 else family)
    d = family.config_to_hf(config)
    arch = d.pop("architectures")[0]
    kwargs = {k: v for k, v in d.items() if k not in ("model_type", "dtype", "torch_dtype")}
    with torch.device("meta"):
        hf = getattr(transformers, arch)(transformers.AutoConfig.for_model(d["model_type"], **kwargs))
    assert sum(p.numel() for p in hf.parameters()) == count_params(abstract_params(config))
