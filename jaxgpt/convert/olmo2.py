"""Hugging Face Olmo2ForCausalLM: the LLaMA layout (llama.py) with each sublayer's RMSNorm on its output
inside the residual, x + norm(f(x)) (``norm_placement='post_sublayer'``), and an RMSNorm over the whole
q and k projections before they are split into heads (``qk_norm='full'``, eps rms_norm_eps).
``attention_bias`` gives q, k, v and o biases; the MLP has none.

HF key                                                  torch_ref key
model.layers.{i}.post_attention_layernorm.weight    <-> layers.{i}.attn_norm.scale
model.layers.{i}.post_feedforward_layernorm.weight  <-> layers.{i}.mlp_norm.scale
model.layers.{i}.self_attn.q_norm / k_norm.weight   <-> layers.{i}.attn.q_norm / k_norm.scale  (H*D,) / (H_kv*D,)
everything else                                     <-> as llama.py
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert import llama
from jaxgpt.convert.common import WINDOWLESS, MAPPED, Field, check_fields, check_options, load_ref, must_be, refuse, rename

ARCHS = ("Olmo2ForCausalLM",)
OPTIONS = {**llama.OPTIONS["llama"], "attention_bias": MAPPED}
OPTIONS.pop("mlp_bias")
FIELDS: dict[str, Field] = {
    **llama.FIELDS, "qk_norm": must_be("full"), "norm_placement": must_be("post_sublayer"),
    **WINDOWLESS,
    "mlp_bias": must_be(False), "qkv_bias": Field(lambda v, c: True, "-> attention_bias"),
    "o_bias": Field(lambda v, c: v == c.qkv_bias, "qkv_bias (one attention_bias)"),
}
RULES = [(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.attn_norm.scale"),
         (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", r"layers.\1.mlp_norm.scale")] + llama.RULES
NORMS = {**llama.NORMS, "attn_norm.scale": "post_attention_layernorm.weight",
         "mlp_norm.scale": "post_feedforward_layernorm.weight"}


def claims(config: ModelConfig) -> bool:
    """Whether save_hf writes ``config`` as OLMo 2."""
    return config.pos == "rope" and config.qk_norm == "full"


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF OLMo 2 config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "OLMo2")
    base = llama.config_from_hf({**d, "model_type": "llama"}, "LlamaForCausalLM")
    return base.replace(qk_norm="full", norm_placement="post_sublayer")


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    skip = lambda key: key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)
    return load_ref(config, rename(tensors, RULES, skip=skip), template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    refuse(check_fields(config, FIELDS, "OLMo2"), "OLMo2")
    d = llama.config_to_hf(config.replace(qk_norm=None, norm_placement="pre"))
    for k in ("mlp_bias", "pretraining_tp"):
        d.pop(k)
    d.update(model_type="olmo2", architectures=list(ARCHS))
    return d


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return llama.params_to_hf(config, ref, NORMS)
