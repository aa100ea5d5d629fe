"""Hugging Face GPTNeoXForCausalLM (Pythia, GPT-NeoX-20B): LayerNorms with biases, partial rotary
(``rotary_dim`` = head_dim x rotary_pct, the 'half' layout inside it), the parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) (``use_parallel_residual``; False: the sequential pre-norm residual),
a biased GELU MLP and an untied output projection.

HF key                                                     torch_ref key
gpt_neox.embed_in.weight                               <-> tok_embed.weight
gpt_neox.layers.{i}.input_layernorm / post_attention_layernorm .weight/.bias <-> attn_norm / mlp_norm .scale/.bias
gpt_neox.layers.{i}.attention.query_key_value (3*H*D, d) <-> attn.q_proj / k_proj / v_proj: rows per head
                                                             [q_h; k_h; v_h] (h = 0..H-1), split and fused back
gpt_neox.layers.{i}.attention.dense                    <-> attn.o_proj
gpt_neox.layers.{i}.mlp.dense_h_to_4h / dense_4h_to_h  <-> mlp.fc_in / fc_out
gpt_neox.final_layer_norm, embed_out (in memory: lm_head) <-> norm, lm_head
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert.common import (ATTNRES_UNUSED, ENGINE_UNUSED, GEMMA_ONLY, MAPPED, WINDOWLESS, UNPADDED, Field, Option, check_fields,
                                   check_options, inert, load_ref, maps_to, must_be, refuse, rename,
                                   rename_layers)

ARCHS = ("GPTNeoXForCausalLM",)
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def rope_params(d: Mapping[str, Any], theta: float, factor: float) -> dict:
    """The RoPE parameters (rope_type, rope_theta, partial_rotary_factor): rope_scaling (which transformers
    prefers) or rope_parameters (transformers >= 5), over ``theta`` and ``factor`` (older top-level keys)."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor, **params}


def _default_rope(v, d) -> bool:
    return not v or (isinstance(v, Mapping) and v.get("rope_type", v.get("type", "default")) == "default"
                     and set(v) <= {"rope_type", "type", "rope_theta", "partial_rotary_factor"})


DEFAULT_ROPE = Option(_default_rope, "default RoPE (no scaling)")
OPTIONS: dict[str, Option] = {
    **{k: MAPPED for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "attention_dropout", "hidden_dropout", "max_position_embeddings",
                           "layer_norm_eps", "tie_word_embeddings", "use_parallel_residual", "attention_bias",
                           "rotary_pct", "rotary_emb_base")},
    "rope_parameters": DEFAULT_ROPE, "rope_scaling": DEFAULT_ROPE,
    "hidden_act": Option(lambda v, d: v in ACTS, f"one of {sorted(ACTS)}"),
    "classifier_dropout": inert("GPTNeoXForSequenceClassification / TokenClassification's head only"),
}
FIELDS: dict[str, Field] = {
    **GEMMA_ONLY, **WINDOWLESS,
    "vocab_size": maps_to("vocab_size"), "d_model": maps_to("hidden_size"), "n_layer": maps_to("num_hidden_layers"),
    "n_head": maps_to("num_attention_heads"), "d_ff": maps_to("intermediate_size"),
    "max_len": maps_to("max_position_embeddings"), "norm_eps": maps_to("layer_norm_eps"),
    "dropout": maps_to("hidden_dropout"), "attn_dropout": maps_to("attention_dropout"),
    "tie_embeddings": maps_to("tie_word_embeddings"), "init_std": maps_to("initializer_range"),
    "rope_base": maps_to("rope_parameters.rope_theta"), "rotary_dim": maps_to("rope_parameters.partial_rotary_factor"),
    "rope_scaling": must_be(None),
    "parallel_residual": maps_to("use_parallel_residual"), "qkv_bias": maps_to("attention_bias"),
    "o_bias": Field(lambda v, c: v == c.qkv_bias, "qkv_bias (one attention_bias)"), "valid_vocab": UNPADDED,
    "mlp": Field(lambda v, c: v in _ACT_OUT, f"one of {sorted(_ACT_OUT)}"),
    "pad_token_id": Field(lambda v, c: v is None, "None (embed_in has no padding row: HF would train that row)"),
    "n_kv_head": Field(lambda v, c: v is None or v == c.n_head, "None or n_head (no GQA)"),
    "d_head": Field(lambda v, c: v is None or v * c.n_head == c.d_model, "None or d_model // n_head"),
    "pos": must_be("rope"), "rope_layout": must_be("half"), "norm": must_be("layernorm"), "norm_bias": must_be(True),
    "mlp_bias": must_be(True), "norm_placement": must_be("pre"), "final_norm": must_be(True),
    "scale_out_init": must_be(False), "embed_scale": must_be(False), "lm_head_bias": must_be(False),
    "moe": must_be(None), "qk_norm": must_be(None), "residual": must_be("standard"), **ATTNRES_UNUSED, **ENGINE_UNUSED,
}
RULES = [(r"gpt_neox\.embed_in\.weight", "tok_embed.weight"),
         (r"gpt_neox\.final_layer_norm\.weight", "norm.scale"), (r"gpt_neox\.final_layer_norm\.bias", "norm.bias"),
         (r"(?:embed_out|lm_head)\.weight", "lm_head.weight")]
_LAYER = {"input_layernorm.weight": "attn_norm.scale", "input_layernorm.bias": "attn_norm.bias",
          "post_attention_layernorm.weight": "mlp_norm.scale", "post_attention_layernorm.bias": "mlp_norm.bias",
          "attention.dense": "attn.o_proj", "mlp.dense_h_to_4h": "mlp.fc_in", "mlp.dense_4h_to_h": "mlp.fc_out",
          "attention.query_key_value": "attn.query_key_value"}


def claims(config: ModelConfig) -> bool:
    """Whether save_hf writes ``config`` as GPT-NeoX: a parallel residual (no other family has one), or a
    RoPE + LayerNorm config it expresses exactly."""
    return config.pos == "rope" and (config.parallel_residual or (
        config.norm == "layernorm" and not check_fields(config, FIELDS, "GPT-NeoX")))


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF GPT-NeoX config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "GPT-NeoX")
    width, heads = d.get("hidden_size", 6144), d.get("num_attention_heads", 64)
    rope = rope_params(d, d.get("rotary_emb_base", 10000.0), d.get("rotary_pct", 0.25))
    rotary = int(width // heads * rope["partial_rotary_factor"])
    bias = d.get("attention_bias", True)
    return ModelConfig(
        vocab_size=d.get("vocab_size", 50432), d_model=width, n_layer=d.get("num_hidden_layers", 44), n_head=heads,
        d_ff=d.get("intermediate_size", 24576), max_len=d.get("max_position_embeddings", 2048), pos="rope",
        rope_base=rope["rope_theta"], rotary_dim=None if rotary == width // heads else rotary, norm="layernorm",
        norm_eps=d.get("layer_norm_eps", 1e-5), mlp=ACTS[d.get("hidden_act", "gelu")], mlp_bias=True,
        qkv_bias=bias, o_bias=bias, parallel_residual=d.get("use_parallel_residual", True),
        tie_embeddings=d.get("tie_word_embeddings", False), dropout=d.get("hidden_dropout", 0.0),
        attn_dropout=d.get("attention_dropout", 0.0), init_std=d.get("initializer_range", 0.02))


def _split(sd: dict, config: ModelConfig) -> dict:
    """attn.query_key_value (3*H*D, ...) rows [q_h; k_h; v_h] per head -> q_proj, k_proj, v_proj."""
    h, d = config.n_head, config.head_dim
    for key in [k for k in sd if ".attn.query_key_value." in k]:
        a = sd.pop(key)
        parts = a.reshape(h, 3, d, *a.shape[1:])  # (H, 3, D[, d_model])
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            sd[key.replace("query_key_value", name)] = np.ascontiguousarray(parts[:, j].reshape(h * d, *a.shape[1:]))
    return sd


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    def skip(key: str) -> bool:  # older checkpoints' mask and RoPE buffers; a tied head is the embedding
        return bool(re.search(r"attention\.(bias|masked_bias|rotary_emb\.inv_freq)$", key)) or (
            key in ("embed_out.weight", "lm_head.weight") and config.tie_embeddings)

    layers = [(rf"gpt_neox\.layers\.(\d+)\.{re.escape(old)}(\.\w+)?", rf"layers.\1.{new}\2") for old, new in _LAYER.items()]
    return load_ref(config, _split(rename(tensors, RULES + layers, skip=skip), config), template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> an HF GPT-NeoX config dict, or one ValueError naming every field it cannot express."""
    refuse(check_fields(config, FIELDS, "GPT-NeoX"), "GPT-NeoX")
    return dict(model_type="gpt_neox", architectures=list(ARCHS), vocab_size=config.vocab_size,
                hidden_size=config.d_model, num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                intermediate_size=config.ffn_dim, hidden_act=_ACT_OUT[config.mlp],
                max_position_embeddings=config.max_len, layer_norm_eps=config.norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_base,
                                 "partial_rotary_factor": (config.rotary_dim or config.head_dim) / config.head_dim},
                use_parallel_residual=config.parallel_residual, attention_bias=config.qkv_bias,
                hidden_dropout=config.dropout, attention_dropout=config.attention_dropout,
                tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """torch_ref layout -> GPTNeoXForCausalLM's saved keys (q/k/v fused per head; embed_out)."""
    top = {"tok_embed.weight": "gpt_neox.embed_in.weight", "norm.scale": "gpt_neox.final_layer_norm.weight",
           "norm.bias": "gpt_neox.final_layer_norm.bias", "lm_head.weight": "embed_out.weight"}
    back = {new: old for old, new in _LAYER.items()}

    def layer(i, rest, a):
        if rest.startswith(("attn.q_proj", "attn.k_proj", "attn.v_proj")):
            return None  # fused below
        for new, old in back.items():
            rest = rest.replace(new, old)
        return f"gpt_neox.layers.{i}.{rest}", a

    out = rename_layers(ref, top, layer)
    h, d = config.n_head, config.head_dim
    for i in range(config.n_layer):
        for leaf in ("weight", "bias"):
            parts = [ref.get(f"layers.{i}.attn.{n}.{leaf}") for n in ("q_proj", "k_proj", "v_proj")]
            if parts[0] is not None:  # (H*D[, d_model]) each -> (H, 3, D[, d_model]) -> (3*H*D[, d_model])
                fused = np.stack([p.reshape(h, d, *p.shape[1:]) for p in parts], axis=1)
                out[f"gpt_neox.layers.{i}.attention.query_key_value.{leaf}"] = fused.reshape(3 * h * d, *parts[0].shape[1:])
    return out
