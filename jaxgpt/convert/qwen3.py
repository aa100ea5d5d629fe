"""Hugging Face Qwen3ForCausalLM: the LLaMA layout (llama.py) with an RMSNorm over each head's D on the
queries and keys before RoPE (``qk_norm='head'``, eps rms_norm_eps) and an explicit ``head_dim``.
``attention_bias`` gives q, k, v and o biases, as LLaMA's; the MLP has none.

HF key                                              torch_ref key
model.layers.{i}.self_attn.q_norm / k_norm.weight <-> layers.{i}.attn.q_norm / k_norm.scale  (D,)
everything else                                   <-> as llama.py
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert import llama
from jaxgpt.convert.common import MAPPED, WINDOWLESS, Field, Option, check_fields, check_options, inert, must_be, refuse

ARCHS = ("Qwen3ForCausalLM",)
# Qwen3's sliding windows are not mapped (yet): a window covering the context masks nothing.
OPTIONS = {**llama.OPTIONS["qwen2"], "attention_bias": MAPPED,
           "sliding_window": Option(lambda v, d: not d.get("use_sliding_window") or llama.WINDOW_COVERS_CONTEXT.ok(v, d),
                                    llama.WINDOW_COVERS_CONTEXT.needs + " when use_sliding_window"),
           "max_window_layers": inert("which layers slide; no window shorter than the context is accepted"),
           "layer_types": Option(lambda v, d: not d.get("use_sliding_window") or llama.LAYER_TYPES_COVER_CONTEXT.ok(v, d),
                                 llama.LAYER_TYPES_COVER_CONTEXT.needs)}
_LLAMA = set(llama.OPTIONS["llama"])
FIELDS: dict[str, Field] = {
    **llama.FIELDS, "qk_norm": must_be("head"), "mlp_bias": must_be(False),
    **WINDOWLESS,
    "qkv_bias": Field(lambda v, c: True, "-> attention_bias"),
    "o_bias": Field(lambda v, c: v == c.qkv_bias, "qkv_bias (one attention_bias)"),
}


def claims(config: ModelConfig) -> bool:
    """Whether save_hf writes ``config`` as Qwen3."""
    return config.pos == "rope" and config.qk_norm == "head"


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF Qwen3 config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "Qwen3")
    kept = {k: v for k, v in d.items() if k in _LLAMA}
    base = llama.config_from_hf({**kept, "model_type": "llama", "head_dim": d.get("head_dim", 128)}, "LlamaForCausalLM")
    return base.replace(qk_norm="head")


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    return llama.params_from_hf(config, tensors, arch, template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    refuse(check_fields(config, FIELDS, "Qwen3"), "Qwen3")
    d = llama.config_to_hf(config.replace(qk_norm=None))
    for k in ("mlp_bias", "pretraining_tp"):
        d.pop(k)
    d.update(model_type="qwen3", architectures=list(ARCHS), use_sliding_window=False, sliding_window=None,
             max_window_layers=config.n_layer)
    return d


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return llama.params_to_hf(config, ref)
