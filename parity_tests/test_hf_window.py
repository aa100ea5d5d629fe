"""Sliding-window HF families everywhere LLaMA runs (hf_family.check_family): a Mistral with
sliding_window=8 and a Qwen2 whose use_sliding_window + max_window_layers mix sliding and global
layers, with sequences and prompts longer than the window; a Mixtral's window loaded and written back;
and jaxgpt's window mask against transformers' own mask function."""
import json

import numpy as np
import pytest
import torch
import transformers
from transformers.masking_utils import sliding_window_causal_mask_function

from conftest import assert_close
from parity_tests.hf_family import check_family, hf_logits, perturb
from jaxgpt import build
from jaxgpt.convert import llama, load_hf, save_hf
from jaxgpt.nn import kernels

SIZES = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=8, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_mask_is_transformers_mask_function(window):
    """kernels.causal_mask(window=W) == transformers' sliding_window_causal_mask_function(W), at a
    decode offset too (queries 5.., keys 0..)."""
    t, off = 12, 5
    rule = sliding_window_causal_mask_function(window)
    want = rule(0, 0, torch.arange(t)[:, None] + off, torch.arange(t + off)[None, :]).numpy()
    assert np.array_equal(np.asarray(kernels.causal_mask(t, t + off, off, window=window)), want)


@pytest.mark.parametrize("max_window_layers,want", [(1, (1,)), (0, None), (2, "none")])
def test_qwen2_window_layers_with_and_without_layer_types(max_window_layers, want):
    """Qwen2's sliding layers from its saved layer_types, and from max_window_layers alone (configs
    written before layer_types): the layers from max_window_layers on slide (transformers' rule)."""
    d = transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=max_window_layers).to_dict()
    older = {k: v for k, v in d.items() if k != "layer_types"}
    for cfg in (llama.config_from_hf(d, "Qwen2ForCausalLM"), llama.config_from_hf(older, "Qwen2ForCausalLM")):
        assert (cfg.sliding_window, cfg.window_layers) == ((None, None) if want == "none" else (8, want))


@pytest.mark.slow
def test_mistral_sliding_window(tmp_path):
    hf = perturb(transformers.MistralForCausalLM(transformers.MistralConfig(
        **SIZES, sliding_window=8, attn_implementation="eager")), scale=0.5)
    config, _ = check_family(hf, tmp_path, "Mistral sliding_window=8", prompt_lens=(5, 19), seq_len=24)
    assert config.sliding_window == 8 and config.window_layers is None
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "mistral" and saved["sliding_window"] == 8


@pytest.mark.slow
def test_qwen2_mixed_sliding_layers(tmp_path):
    hf = perturb(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=8, max_window_layers=1, attn_implementation="eager")),
        scale=0.5)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    # the engine's pure-JAX pages ('gather': the window folded into the cache's mask); Mistral's ran the C++ kernel
    config, _ = check_family(hf, tmp_path, "Qwen2 sliding layer 1 of 2", prompt_lens=(5, 19), seq_len=24,
                             engine_kw={"paged_kernel": "gather"})
    assert config.sliding_window == 8 and config.window_layers == (1,)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["layer_types"] == hf.config.layer_types and saved["use_sliding_window"] is True
    assert saved["max_window_layers"] == 1


@pytest.mark.slow
def test_mixtral_sliding_window(tmp_path):
    """A Mixtral slides every layer as Mistral does: load_hf's logits are transformers' over 20
    positions (window 6), and save_hf writes the window back."""
    hf = perturb(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**SIZES, "num_hidden_layers": 1}, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        attn_implementation="eager")), scale=0.5)
    hf.save_pretrained(tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    assert config.sliding_window == 6
    ids = np.random.default_rng(0).integers(0, 50, (2, 20))
    ours = np.asarray(build(config).apply({"params": params}, ids))
    assert_close(ours, hf_logits(hf, ids), "load_hf Mixtral sliding_window=6")
    save_hf(tmp_path / "ours", config, params)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["sliding_window"] == 6
