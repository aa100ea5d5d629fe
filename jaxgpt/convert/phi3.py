"""Hugging Face Phi3ForCausalLM: the LLaMA layout (llama.py) with fused projections, split on import
and fused again on export, and optional partial rotary (``partial_rotary_factor`` -> ``rotary_dim``).
No biases; default RoPE only (its 'longrope' / 'su' scaling is refused, by name: rope_scaling=...).

HF key                                          torch_ref key
model.layers.{i}.self_attn.qkv_proj.weight  <-> attn.q_proj / k_proj / v_proj: rows [q (H*D); k (H_kv*D); v (H_kv*D)]
model.layers.{i}.mlp.gate_up_proj.weight    <-> mlp.gate_proj / up_proj: rows [gate (d_ff); up (d_ff)]
everything else                             <-> as llama.py
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert import llama
from jaxgpt.convert.common import (WINDOWLESS, MAPPED, Field, Option, check_fields, check_options, equals, inert, load_ref,
                                   maps_to, must_be, refuse, rename, split_packed)
from jaxgpt.convert.gpt_neox import DEFAULT_ROPE, rope_params

ARCHS = ("Phi3ForCausalLM",)
# Phi3Config's defaults, for config dicts that leave a key out.
DEFAULTS = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000)
OPTIONS: dict[str, Option] = {
    **{k: MAPPED for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                           "tie_word_embeddings", "attention_dropout", "initializer_range", "rope_theta",
                           "partial_rotary_factor", "pad_token_id")},
    "rope_parameters": DEFAULT_ROPE, "rope_scaling": DEFAULT_ROPE, "hidden_act": equals("silu"),
    "resid_pdrop": equals(0.0, 0), "embd_pdrop": inert("not read by transformers' Phi3 (no embedding dropout)"),
    "original_max_position_embeddings": inert("read by 'longrope' scaling only, which is refused"),
    "sliding_window": llama.WINDOW_COVERS_CONTEXT,
}
FIELDS: dict[str, Field] = {
    **llama.FIELDS, "rotary_dim": maps_to("rope_parameters.partial_rotary_factor"), "rope_scaling": must_be(None),
    **WINDOWLESS,
    "qkv_bias": must_be(False), "o_bias": must_be(False), "mlp_bias": must_be(False),
    "d_head": Field(lambda v, c: v is None or v * c.n_head == c.d_model, "None or d_model // n_head"),
}


def claims(config: ModelConfig) -> bool:
    """Whether save_hf writes ``config`` as Phi-3: partial rotary on a LLaMA-like model (full rotary
    exports as LLaMA, the same function)."""
    return config.pos == "rope" and config.norm == "rmsnorm" and config.rotary_dim not in (None, config.head_dim)


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF Phi-3 config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "Phi3")
    d = {**DEFAULTS, **d}
    rope = rope_params(d, d.get("rope_theta", 10000.0), d.get("partial_rotary_factor", 1.0))
    kept = {k: v for k, v in d.items() if k in llama.OPTIONS["llama"] and k not in ("rope_scaling", "rope_theta")}
    base = llama.config_from_hf({**kept, "model_type": "llama", "rope_parameters": {"rope_theta": rope["rope_theta"]}},
                                "LlamaForCausalLM")
    rotary = int(base.head_dim * rope["partial_rotary_factor"])
    return base.replace(rotary_dim=None if rotary == base.head_dim else rotary)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    skip = lambda key: key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)
    sd = rename(tensors, llama.RULES, skip=skip)
    sd = split_packed(sd, "qkv_proj", (config.n_head * config.head_dim,) + (config.kv_heads * config.head_dim,) * 2)
    for key in [k for k in sd if k.endswith(".mlp.gate_up_proj.weight")]:
        gate, up = np.split(sd.pop(key), 2, axis=0)
        sd[key.replace("gate_up_proj", "gate_proj")], sd[key.replace("gate_up_proj", "up_proj")] = gate, up
    return load_ref(config, sd, template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    refuse(check_fields(config, FIELDS, "Phi3"), "Phi3")
    d = llama.config_to_hf(config.replace(rotary_dim=None))
    for k in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim", "rope_theta", "rope_scaling"):
        d.pop(k)
    d.update(model_type="phi3", architectures=list(ARCHS), resid_pdrop=0.0, embd_pdrop=0.0, sliding_window=None,
             original_max_position_embeddings=config.max_len,
             rope_parameters={"rope_type": "default", "rope_theta": config.rope_base,
                              "partial_rotary_factor": (config.rotary_dim or config.head_dim) / config.head_dim})
    return d


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = llama.params_to_hf(config, ref)
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [out.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"], axis=0)
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")], axis=0)
    return out
