"""Hugging Face GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (text): the LLaMA layout (llama.py)
with Gemma's numerics.

Gemma: RMSNorm scaling by (1 + w) (``norm_unit_offset``; HF stores w, initialised to 0), a GeGLU MLP
with the tanh GELU (``mlp='geglu_tanh'``), token embeddings times sqrt(hidden_size) (``embed_scale``),
q/k/v/o biases from ``attention_bias``. Gemma 2 adds a norm after each sublayer
(``norm_placement='sandwich'``), the score multiplier query_pre_attn_scalar ** -0.5 (``attn_scale``) and
two soft-caps (``attn_softcap``, ``logit_softcap``), and its ``layer_types`` (default: even layers
slide) with ``sliding_window`` map to ModelConfig.sliding_window / window_layers both ways. Gemma 3
(model_type 'gemma3_text') is Gemma 2 with (1 + w) q/k RMSNorms per head (``qk_norm='head'``), soft-caps
optional, every sixth layer global by default, and the sliding layers' own RoPE base without scaling
(``rope_local_base``; the global layers' base and scaling are ``rope_base`` / ``rope_scaling``).

HF key                                                  torch_ref key
model.embed_tokens.weight                           <-> tok_embed.weight
model.layers.{i}.self_attn.{q,k,v,o}_proj           <-> layers.{i}.attn.{q,k,v,o}_proj
model.layers.{i}.mlp.{gate,up,down}_proj            <-> layers.{i}.mlp.{gate,up,down}_proj
model.layers.{i}.input_layernorm.weight             <-> layers.{i}.attn_norm.scale
Gemma:   post_attention_layernorm.weight            <-> mlp_norm.scale
Gemma 2/3: post_attention_layernorm.weight          <-> attn_post_norm.scale
         pre_feedforward_layernorm.weight           <-> mlp_norm.scale
         post_feedforward_layernorm.weight          <-> mlp_post_norm.scale
Gemma 3: self_attn.{q,k}_norm.weight                <-> attn.{q,k}_norm.scale
model.norm.weight, lm_head.weight                   <-> norm.scale, lm_head.weight (absent when tied)
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert import llama
from jaxgpt.convert.common import (ATTNRES_UNUSED, ENGINE_UNUSED, MAPPED, UNPADDED, Field, Option, check_fields,
                                   check_options, equals, inert, load_ref, maps_to, must_be, padding_row, refuse, rename,
                                   rename_layers)

ARCHS = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
NAMES = {"gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}
_TANH = ("gelu_pytorch_tanh", "gelu")  # transformers reads a Gemma config's legacy 'gelu' as the tanh GELU

def _layer_types_ok(types, d: Mapping[str, Any]) -> bool:
    return len(types) == d.get("num_hidden_layers", 26) and set(types) <= set(llama.KINDS) and (
        "sliding_attention" not in types or d.get("sliding_window") is not None)


_COMMON: dict[str, Option] = {
    **{k: v for k, v in llama._COMMON.items() if k not in ("hidden_act", "pretraining_tp")},
    "attention_bias": MAPPED,
    "use_bidirectional_attention": equals(None, False),
}
OPTIONS: dict[str, dict[str, Option]] = {
    "gemma": {**_COMMON, "hidden_act": equals(*_TANH), "hidden_activation": equals(None, "gelu_pytorch_tanh")},
    "gemma2": {**_COMMON, "hidden_activation": equals("gelu_pytorch_tanh"), "hidden_act": equals(None, *_TANH),
               "query_pre_attn_scalar": MAPPED, "attn_logit_softcapping": MAPPED, "final_logit_softcapping": MAPPED,
               "sliding_window": llama._WINDOW,
               "layer_types": Option(lambda v, d: v is None or _layer_types_ok(v, d),
                                     f"one of {llama.KINDS} per layer; sliding layers need a sliding_window"),
               "cache_implementation": inert("the KV cache class transformers' generate uses")},
}
OPTIONS["gemma3_text"] = {
    **OPTIONS["gemma2"], "use_bidirectional_attention": equals(None, False),
    "rope_parameters": Option(lambda v, d: _gemma3_rope_problem(d) is None,
                              lambda v, d: f"RoPE per layer type that jaxgpt runs exactly; here: {_gemma3_rope_problem(d)}"),
    "rope_scaling": Option(lambda v, d: _gemma3_rope_problem(d) is None, "a RoPE scaling jaxgpt runs exactly"),
    "rope_local_base_freq": MAPPED, "sliding_window_pattern": MAPPED}


def _sandwich(c) -> bool:
    return c.norm_placement == "sandwich"


def _gemma3_rope(d: Mapping[str, Any]) -> tuple[Any, float, float]:
    """(global scaling, global base, local base) of a Gemma 3 config: transformers >= 5 nests
    rope_parameters by layer type; older configs give rope_theta, rope_local_base_freq and rope_scaling."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = {**(d.get("rope_scaling") or {}), **params}, {}
    full = {"rope_type": "default", "rope_theta": d.get("rope_theta", 1_000_000.0), **full}
    local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0), **local}
    if local["rope_type"] != "default":
        raise ValueError(f"sliding layers' rope_type={local['rope_type']!r}: only 'default' is implemented")
    scaling, base = llama._rope({**d, "rope_parameters": full, "rope_scaling": None})
    return scaling, base, float(local["rope_theta"])


def _gemma3_rope_problem(d: Mapping[str, Any]) -> str | None:
    try:
        scaling = _gemma3_rope(d)[0]
        if scaling is not None:
            scaling.check_model(llama._head_dim(d) or 256, llama._context(d))
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _query_scalar(config) -> float | int | None:
    """Gemma 2's query_pre_attn_scalar for ``config.attn_scale`` (head_dim when None), or None when no
    value gives back exactly that multiplier (HF computes query_pre_attn_scalar ** -0.5)."""
    if config.attn_scale is None:
        return config.head_dim
    q = config.attn_scale ** -2
    for candidate in (round(q), q):
        if candidate > 0 and candidate ** -0.5 == config.attn_scale:
            return candidate
    return None


FIELDS: dict[str, Field] = {
    **{k: v for k, v in llama.FIELDS.items() if k in (
        "vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_head", "d_ff", "max_len", "rope_base",
        "norm_eps", "attn_dropout", "tie_embeddings", "init_std", "pad_token_id", "pos", "rope_layout", "norm",
        "norm_bias", "final_norm", "dropout", "scale_out_init", "residual", "lm_head_bias", "moe")},
    "valid_vocab": UNPADDED,
    "qkv_bias": maps_to("attention_bias"), "o_bias": Field(lambda v, c: v == c.qkv_bias, "qkv_bias (attention_bias)"),
    "mlp_bias": must_be(False), "mlp": must_be("geglu_tanh"), "norm_unit_offset": must_be(True),
    "embed_scale": must_be(True), "norm_placement": must_be("pre", "sandwich"),
    "attn_scale": Field(lambda v, c: _query_scalar(c) is not None if _sandwich(c) else v in (None, c.head_dim ** -0.5),
                        "-> query_pre_attn_scalar ** -0.5 (Gemma 2: an exact inverse square; Gemma: None)"),
    "attn_softcap": Field(lambda v, c: v is None or _sandwich(c), "-> attn_logit_softcapping (Gemma 2; Gemma: None)"),
    "logit_softcap": Field(lambda v, c: v is None or _sandwich(c), "-> final_logit_softcapping (Gemma 2; Gemma: None)"),
    "rope_scaling": Field(lambda v, c: v is None or _family(c) == "gemma3_text" and (
        c.rope_local_base is not None or c.sliding_window is None), "None (Gemma 3: its global layers' scaling, "
        "with rope_local_base set where layers slide)"),
    "rotary_dim": Field(lambda v, c: v is None or v == c.head_dim, "None or head_dim"),
    "parallel_residual": must_be(False),
    "qk_norm": Field(lambda v, c: v is None or (v == "head" and _sandwich(c)), "None, or 'head' (Gemma 3)"),
    "rope_local_base": Field(lambda v, c: v is None or _family(c) == "gemma3_text",
                             "None, or Gemma 3's (qk_norm='head') sliding-layer rope_theta"),
    "sliding_window": Field(lambda v, c: v is None or _sandwich(c), "-> sliding_window (Gemma 2; Gemma: None)"),
    "window_layers": Field(lambda v, c: v is None or _sandwich(c), "-> layer_types (Gemma 2; Gemma: None)"),
    **ATTNRES_UNUSED, **ENGINE_UNUSED,
}

_LAYER_KEYS = {  # torch_ref layer key -> HF, per family (the rest as llama.py's)
    "gemma": {"attn_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight"},
    "gemma2": {"attn_norm.scale": "input_layernorm.weight", "attn_post_norm.scale": "post_attention_layernorm.weight",
               "mlp_norm.scale": "pre_feedforward_layernorm.weight",
               "mlp_post_norm.scale": "post_feedforward_layernorm.weight"},
}
_LAYER_KEYS["gemma3_text"] = {**_LAYER_KEYS["gemma2"], "attn.q_norm.scale": "self_attn.q_norm.weight",
                              "attn.k_norm.scale": "self_attn.k_norm.weight"}


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF Gemma / Gemma 2 / Gemma 3 (text) config dict -> ModelConfig; every unsupported option named at once."""
    family = d.get("model_type", "gemma")
    check_options(d, OPTIONS[family], NAMES[family])
    heads = d.get("num_attention_heads", 16)
    bias = bool(d.get("attention_bias", False))
    config = ModelConfig(
        vocab_size=d.get("vocab_size", 256000), max_len=llama._context(d), d_model=d.get("hidden_size", 3072),
        n_layer=d.get("num_hidden_layers", 28), n_head=heads, n_kv_head=d.get("num_key_value_heads") or heads,
        d_head=llama._head_dim(d), d_ff=d.get("intermediate_size", 24576), pos="rope", rope_layout="half",
        rope_base=(_gemma3_rope(d) if family == "gemma3_text" else llama._rope(d))[1], norm="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6), norm_unit_offset=True,
        mlp="geglu_tanh", mlp_bias=False, qkv_bias=bias, o_bias=bias, embed_scale=True,
        tie_embeddings=d.get("tie_word_embeddings", True), attn_dropout=d.get("attention_dropout", 0.0),
        init_std=d.get("initializer_range", 0.02), pad_token_id=padding_row(d))
    if family == "gemma":
        return config
    scalar = d.get("query_pre_attn_scalar", 256)
    window, window_layers = _window_layers(d, config.n_layer, config.max_len)
    if family == "gemma3_text":
        scaling, base, local = _gemma3_rope(d)
        config = config.replace(qk_norm="head", rope_scaling=scaling, rope_base=base,
                                rope_local_base=None if local == base and scaling is None else local)
    return config.replace(
        sliding_window=window, window_layers=window_layers, norm_placement="sandwich",
        attn_scale=None if scalar == config.head_dim else scalar ** -0.5,
        attn_softcap=d.get("attn_logit_softcapping"), logit_softcap=d.get("final_logit_softcapping"))


def _window_layers(d: Mapping[str, Any], n_layer: int, context: int) -> tuple[int | None, tuple | None]:
    """(sliding_window, window_layers) of a Gemma 2 / 3 config: transformers' default layer_types make
    every ``pattern``-th layer global (Gemma 2: 2, so the even layers slide; Gemma 3: sliding_window_pattern,
    6); a window covering the context masks nothing (None)."""
    window = d.get("sliding_window", 4096)
    pattern = d.get("sliding_window_pattern", 6) if d.get("model_type") == "gemma3_text" else 2
    types = d.get("layer_types") or [llama.KINDS[bool((i + 1) % pattern)] for i in range(n_layer)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if window is None or window >= context or not sliding:
        return None, None
    return window, None if len(sliding) == n_layer else sliding


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    keys = {v: k for k, v in _LAYER_KEYS[_family(config)].items()}
    rules = [(rf"model\.layers\.(\d+)\.{hf.replace('.', '[.]')}", rf"layers.\1.{ref}") for hf, ref in keys.items()]
    rules += [r for r in llama.RULES if "layernorm" not in r[0]]

    def skip(key: str) -> bool:  # RoPE buffers of older checkpoints; a tied head is the embedding
        return key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)

    return load_ref(config, rename(tensors, rules, skip=skip), template)


def claims(config: ModelConfig) -> bool:
    """Whether save_hf writes ``config`` as a Gemma: (1 + w) norms are Gemma's alone."""
    return config.norm_unit_offset


def _family(config: ModelConfig) -> str:
    return ("gemma3_text" if config.qk_norm is not None else "gemma2") if _sandwich(config) else "gemma"


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> an HF Gemma config dict (Gemma 2 when norm_placement='sandwich', Gemma 3 with
    qk_norm='head' too), or one ValueError naming every field none can express."""
    family = _family(config)
    refuse(check_fields(config, FIELDS, NAMES[family]), NAMES[family])
    d = dict(model_type=family, architectures=[ARCHS[family]], vocab_size=config.vocab_size,
             hidden_size=config.d_model, intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layer,
             num_attention_heads=config.n_head, num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
             max_position_embeddings=config.max_len, rms_norm_eps=config.norm_eps,
             rope_parameters={"rope_theta": config.rope_base, "rope_type": "default"},
             tie_word_embeddings=config.tie_embeddings, attention_bias=config.qkv_bias,
             attention_dropout=config.attention_dropout, initializer_range=config.init_std, bos_token_id=None,
             eos_token_id=None, pad_token_id=config.pad_token_id)
    if family == "gemma":
        return {**d, "hidden_act": "gelu_pytorch_tanh"}
    # layers without a window attend over the whole context: transformers' full_attention
    sliding = [config.layer_window(i) is not None for i in range(config.n_layer)]
    if family == "gemma3_text":
        glob = {"rope_theta": config.rope_base, "rope_type": "default"} if config.rope_scaling is None else \
            config.rope_scaling.to_hf(config.rope_base)
        local = config.rope_base if config.rope_local_base is None else config.rope_local_base
        d["rope_parameters"] = {"full_attention": glob,
                                "sliding_attention": {"rope_theta": local, "rope_type": "default"}}
    return {**d, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _query_scalar(config),
            "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.logit_softcap,
            "sliding_window": config.sliding_window or config.max_len, "layer_types": [llama.KINDS[s] for s in sliding]}


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    top = {"tok_embed.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    norms = _LAYER_KEYS[_family(config)]

    def layer(i, rest, a):
        rest = norms.get(rest) or rest.replace("attn.", "self_attn.")
        return f"model.layers.{i}.{rest}", a

    return rename_layers(ref, top, layer)
