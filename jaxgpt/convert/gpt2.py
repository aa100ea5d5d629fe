"""The GPT-2 layout: Hugging Face GPT2LMHeadModel / GPT2Model, and (through ``to_ref``) nanoGPT and
seed 003, which share it up to a prefix and HF's Conv1D orientation.

HF key                                  torch_ref key
transformer.wte / wpe .weight       <-> tok_embed / pos_embed .weight
transformer.h.{i}.ln_1 / ln_2       <-> layers.{i}.attn_norm / mlp_norm (weight <-> scale)
transformer.h.{i}.attn.c_attn       <-> attn.q_proj / k_proj / v_proj (packed [q; k; v], Conv1D (in, out))
transformer.h.{i}.attn.c_proj       <-> attn.o_proj
transformer.h.{i}.mlp.c_fc / c_proj <-> mlp.fc_in / fc_out
transformer.ln_f, lm_head           <-> norm, lm_head (absent when tied)
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert.common import (ATTNRES_UNUSED, ENGINE_UNUSED, GEMMA_ONLY, MAPPED, Option, check_fields, check_options, equals, inert,
                                   load_ref, maps_to, must_be, one_of, refuse, rename, rename_layers, split_packed, UNPADDED, unused,
                                   Field)

ARCHS = ("GPT2LMHeadModel", "GPT2Model")
ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# GPT2Config's defaults, for config dicts that leave a key out.
DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                layer_norm_epsilon=1e-5, initializer_range=0.02, tie_word_embeddings=True)

OPTIONS: dict[str, Option] = {
    **{k: MAPPED for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                           "layer_norm_epsilon", "resid_pdrop", "attn_pdrop", "initializer_range",
                           "tie_word_embeddings")},
    "activation_function": one_of(ACTS),
    "embd_pdrop": Option(lambda v, d: v == d.get("resid_pdrop", 0.1), "equal to resid_pdrop (one dropout rate)"),
    "scale_attn_weights": equals(True),
    "scale_attn_by_inverse_layer_idx": equals(False),
    # Upcasts and reorders q.k scaling inside the softmax: the same function, only a different
    # rounding in half precision; jaxgpt computes attention scores in float32 anyway.
    "reorder_and_upcast_attn": inert("precision only: the same attention, computed in float32"),
    "n_ctx": inert("old name of n_positions, not used by the model"),
    **{k: inert("GPT2DoubleHeadsModel's summary head only") for k in (
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout")},
}

# Every ModelConfig field -> how HF GPT-2 expresses it (test_convert_strict checks the coverage).
FIELDS: dict[str, Field] = {
    "vocab_size": maps_to("vocab_size"), "d_model": maps_to("n_embd"), "n_layer": maps_to("n_layer"),
    "n_head": maps_to("n_head"), "d_ff": maps_to("n_inner"), "max_len": maps_to("n_positions"),
    "norm_eps": maps_to("layer_norm_epsilon"), "dropout": maps_to("resid_pdrop, embd_pdrop"),
    "attn_dropout": maps_to("attn_pdrop"), "tie_embeddings": maps_to("tie_word_embeddings"),
    "init_std": maps_to("initializer_range"), "valid_vocab": UNPADDED,
    "pad_token_id": Field(lambda v, c: v is None, "None (its wte has no padding row: HF would train that row)"),
    "n_kv_head": Field(lambda v, c: v is None or v == c.n_head, "None or n_head (no GQA)"),
    "d_head": Field(lambda v, c: v is None or v * c.n_head == c.d_model, "None or d_model // n_head"),
    "sliding_window": must_be(None), "window_layers": must_be(None),
    "pos": must_be("learned"), "rope_base": unused("pos must be 'learned'"),
    "rope_scaling": unused("pos must be 'learned'"),
    "rope_layout": unused("pos must be 'learned'"), "norm": must_be("layernorm"), "norm_bias": must_be(True),
    "mlp": Field(lambda v, c: v in _ACT_OUT, f"one of {sorted(_ACT_OUT)}"), "mlp_bias": must_be(True),
    "qkv_bias": must_be(True), "o_bias": must_be(True), "norm_placement": must_be("pre"),
    "final_norm": must_be(True), "scale_out_init": must_be(True), "embed_scale": must_be(False),
    "lm_head_bias": must_be(False), "moe": must_be(None),
    "rotary_dim": unused("pos must be 'learned'"), "parallel_residual": must_be(False), "qk_norm": must_be(None),
    "residual": must_be("standard"), **ATTNRES_UNUSED, **ENGINE_UNUSED, **GEMMA_ONLY,
}

RULES = [(r"(?:transformer\.)?" + pattern, repl) for pattern, repl in [
    (r"wte\.weight", "tok_embed.weight"),
    (r"wpe\.weight", "pos_embed.weight"),
    (r"h\.(\d+)\.ln_1\.weight", r"layers.\1.attn_norm.scale"),
    (r"h\.(\d+)\.ln_1\.bias", r"layers.\1.attn_norm.bias"),
    (r"h\.(\d+)\.ln_2\.weight", r"layers.\1.mlp_norm.scale"),
    (r"h\.(\d+)\.ln_2\.bias", r"layers.\1.mlp_norm.bias"),
    (r"h\.(\d+)\.attn\.c_attn\.(\w+)", r"layers.\1.attn.c_attn.\2"),
    (r"h\.(\d+)\.attn\.c_proj\.(\w+)", r"layers.\1.attn.o_proj.\2"),
    (r"h\.(\d+)\.mlp\.c_fc\.(\w+)", r"layers.\1.mlp.fc_in.\2"),
    (r"h\.(\d+)\.mlp\.c_proj\.(\w+)", r"layers.\1.mlp.fc_out.\2"),
    (r"ln_f\.weight", "norm.scale"),
    (r"ln_f\.bias", "norm.bias"),
]]


def _is_buffer(key: str) -> bool:
    # Causal-mask buffers saved by older GPT-2 / nanoGPT / seed 003 code: not parameters.
    return bool(re.search(r"\.attn\.(bias|masked_bias|mask)$", key))


def to_ref(sd: Mapping[str, Any], config: ModelConfig, conv1d: bool) -> dict:
    """GPT-2-layout keys (HF with ``conv1d=True``, nanoGPT / seed 003 Linear otherwise) -> torch_ref."""
    tied = config.tie_embeddings
    ref = rename(sd, RULES, skip=lambda k: _is_buffer(k) or (k == "lm_head.weight" and tied))
    if conv1d:  # HF's Conv1D stores (in, out): make it torch Linear's (out, in)
        for k in [k for k in ref if k.endswith(".weight") and ref[k].ndim == 2 and k.startswith("layers.")]:
            ref[k] = np.ascontiguousarray(ref[k].T)
    return split_packed(ref, "c_attn", (config.d_model,) * 3)


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF GPT-2 config dict -> ModelConfig; every unsupported option named in one ValueError."""
    check_options(d, OPTIONS, "GPT-2")
    d = {**DEFAULTS, **d}
    return ModelConfig(
        vocab_size=d["vocab_size"], max_len=d["n_positions"], d_model=d["n_embd"], n_layer=d["n_layer"],
        n_head=d["n_head"], d_ff=d["n_inner"] or 4 * d["n_embd"], pos="learned", norm="layernorm",
        norm_eps=d["layer_norm_epsilon"], mlp=ACTS[d["activation_function"]], mlp_bias=True, qkv_bias=True,
        o_bias=True, tie_embeddings=d["tie_word_embeddings"], dropout=d["resid_pdrop"], attn_dropout=d["attn_pdrop"],
        init_std=d["initializer_range"], scale_out_init=True)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    return load_ref(config, to_ref(tensors, config, conv1d=True), template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> HF GPT-2 config dict, or one ValueError naming every field GPT-2 cannot express."""
    refuse(check_fields(config, FIELDS, "GPT-2"), "GPT-2")
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
                n_positions=config.max_len, n_embd=config.d_model, n_layer=config.n_layer, n_head=config.n_head,
                n_inner=config.ffn_dim, activation_function=_ACT_OUT[config.mlp], layer_norm_epsilon=config.norm_eps,
                resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.attention_dropout,
                initializer_range=config.init_std, tie_word_embeddings=config.tie_embeddings,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                bos_token_id=None, eos_token_id=None)


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """torch_ref layout -> GPT2LMHeadModel keys (Conv1D weights (in, out); no lm_head when tied)."""
    top = {"tok_embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
           "norm.scale": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
           "lm_head.weight": "lm_head.weight"}
    names = {"attn_norm.scale": "ln_1.weight", "attn_norm.bias": "ln_1.bias", "mlp_norm.scale": "ln_2.weight",
             "mlp_norm.bias": "ln_2.bias", "attn.o_proj": "attn.c_proj", "mlp.fc_in": "mlp.c_fc",
             "mlp.fc_out": "mlp.c_proj"}

    def layer(i, rest, a):
        if rest.startswith(("attn.q_proj", "attn.k_proj", "attn.v_proj")):
            return None  # packed into c_attn below
        for old, new in names.items():
            rest = rest.replace(old, new)
        return f"transformer.h.{i}.{rest}", np.ascontiguousarray(a.T) if a.ndim == 2 else a

    out = rename_layers(ref, top, layer)
    for i in range(config.n_layer):
        parts = [ref[f"layers.{i}.attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]
        out[f"transformer.h.{i}.attn.c_attn.weight"] = np.ascontiguousarray(np.concatenate(parts, 0).T)
        out[f"transformer.h.{i}.attn.c_attn.bias"] = np.concatenate(
            [ref[f"layers.{i}.attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
    return out
