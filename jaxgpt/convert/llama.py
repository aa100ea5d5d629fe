"""The LLaMA layout, shared by Hugging Face LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM:
RoPE ('half' layout), RMSNorm, SwiGLU, GQA. The families differ only in options:
LLaMA ``attention_bias`` (q, k, v and o biases) and ``mlp_bias``; Qwen2 always has q/k/v biases and
no o bias; Mistral slides every layer's attention over a window (``sliding_window``), Qwen2 the
layers its ``layer_types`` (or use_sliding_window + max_window_layers) name: ModelConfig.sliding_window
and window_layers, both ways (a window covering the whole context is plain causal attention: None).

HF key                                                torch_ref key
model.embed_tokens.weight                         <-> tok_embed.weight
model.layers.{i}.self_attn.{q,k,v,o}_proj         <-> layers.{i}.attn.{q,k,v,o}_proj
model.layers.{i}.mlp.{gate,up,down}_proj          <-> layers.{i}.mlp.{gate,up,down}_proj
model.layers.{i}.input_layernorm / post_attention_layernorm .weight <-> attn_norm / mlp_norm .scale
model.norm.weight, lm_head.weight                 <-> norm.scale, lm_head.weight (absent when tied)
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ROPE_TYPES, ModelConfig, RopeScaling
from jaxgpt.convert.common import (ATTNRES_UNUSED, ENGINE_UNUSED, GEMMA_ONLY, MAPPED, UNPADDED, Field, Option, check_fields, check_options, equals,
                                   inert, load_ref, maps_to, must_be, padding_row, refuse, rename, rename_layers, unused)

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
NAMES = {"llama": "LLaMA", "qwen2": "Qwen2", "mistral": "Mistral"}


def _rope(d: Mapping[str, Any]) -> tuple[RopeScaling | None, float]:
    """(scaling, theta) from transformers >= 5 ``rope_parameters`` or the older rope_theta/rope_scaling."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters={params!r} is not a dict")
    theta = params.get("rope_theta")
    return RopeScaling.from_hf(params, _context(d)), float(theta if theta is not None else d.get("rope_theta", 10000.0))


def _rope_problem(d: Mapping[str, Any]) -> str | None:
    """Why jaxgpt cannot run this config's RoPE exactly, or None."""
    try:
        scaling = _rope(d)[0]
        if scaling is not None:
            scaling.check_model(_head_dim(d) or d.get("hidden_size", 4096) // d.get("num_attention_heads", 32), _context(d))
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _head_dim(d: Mapping[str, Any]) -> int | None:
    """config.json's head_dim when it differs from hidden_size / num_attention_heads, else None."""
    width, heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
    given = d.get("head_dim")
    return None if given is None or (given * heads == width) else given


def _context(d: Mapping[str, Any]) -> int:
    return d.get("max_position_embeddings", 2048)


KINDS = ("full_attention", "sliding_attention")


def _window(d: Mapping[str, Any]) -> int | None:
    """The window the family's model applies: Qwen2's only with use_sliding_window (its config sets
    it to None otherwise); None where it covers the whole context (it masks nothing there)."""
    w = d.get("sliding_window")
    if d.get("model_type") == "qwen2" and not d.get("use_sliding_window"):
        return None
    return None if w is None or w >= _context(d) else w


def _qwen2_types(d: Mapping[str, Any]) -> list:
    """Qwen2's layer kinds: layer_types, else transformers' rule (layers >= max_window_layers slide)."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    slide = d.get("use_sliding_window") and d.get("sliding_window") is not None
    return [KINDS[bool(slide and i >= d.get("max_window_layers", 28))] for i in range(d.get("num_hidden_layers", 32))]


def _qwen2_types_ok(types, d) -> bool:
    kinds = _qwen2_types(d)
    if len(kinds) != d.get("num_hidden_layers", 32) or not set(kinds) <= set(KINDS):
        return False
    # sliding layers need the window transformers applies (it refuses to build their mask without one)
    return "sliding_attention" not in kinds or (d.get("use_sliding_window") and d.get("sliding_window") is not None)


def _window_layers(d: Mapping[str, Any]) -> tuple[int | None, tuple | None]:
    """(sliding_window, window_layers) of an HF config dict: Mistral slides every layer."""
    window = _window(d)
    if window is None or d.get("model_type") != "qwen2":
        return window, None
    sliding = tuple(i for i, t in enumerate(_qwen2_types(d)) if t == "sliding_attention")
    if not sliding:
        return None, None
    return window, None if len(sliding) == d.get("num_hidden_layers", 32) else sliding


_ROPE = Option(lambda v, d: _rope_problem(d) is None,
               lambda v, d: f"rope_type 'default' or one of {ROPE_TYPES} that runs exactly; here: {_rope_problem(d)}")
_COMMON: dict[str, Option] = {
    **{k: MAPPED for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                           "tie_word_embeddings", "attention_dropout", "initializer_range", "rope_theta",
                           "pad_token_id")},
    "rope_parameters": _ROPE, "rope_scaling": _ROPE,
    "hidden_act": equals("silu"),
    "head_dim": MAPPED,
    "pretraining_tp": equals(1, None),
}
_WINDOW = Option(lambda v, d: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                 "None or a window of >= 1 positions")
# Families that map no window (Phi-3, Qwen3): a window covering the context
# masks nothing, so it is accepted; a shorter one is refused by name.
WINDOW_COVERS_CONTEXT = Option(lambda v, d: v is None or v >= _context(d),
                               "None or >= max_position_embeddings (the context)")
LAYER_TYPES_COVER_CONTEXT = Option(
    lambda v, d: v is None or all(t == "full_attention" or (t == "sliding_attention" and WINDOW_COVERS_CONTEXT.ok(
        d.get("sliding_window"), d)) for t in v),
    "full_attention layers, or a sliding window covering the context")
OPTIONS: dict[str, dict[str, Option]] = {
    "llama": {**_COMMON, "attention_bias": MAPPED, "mlp_bias": MAPPED},
    "qwen2": {**_COMMON, "use_sliding_window": MAPPED,
              "sliding_window": Option(lambda v, d: not d.get("use_sliding_window") or _WINDOW.ok(v, d),
                                       _WINDOW.needs + " when use_sliding_window"),
              "max_window_layers": MAPPED,  # -> window_layers, where layer_types is absent
              "layer_types": Option(_qwen2_types_ok, f"one of {KINDS} per layer; sliding layers need "
                                                     "use_sliding_window and a sliding_window")},
    # MistralForCausalLM slides every layer whatever layer_types says (transformers warns and ignores it)
    "mistral": {**_COMMON, "sliding_window": _WINDOW,
                "layer_types": inert("MistralForCausalLM ignores it: every layer slides when sliding_window is set")},
}
_BIASES = {"llama": None, "qwen2": (True, False, False), "mistral": (False, False, False)}  # qkv, o, mlp

FIELDS: dict[str, Field] = {
    "vocab_size": maps_to("vocab_size"), "d_model": maps_to("hidden_size"), "n_layer": maps_to("num_hidden_layers"),
    "n_head": maps_to("num_attention_heads"), "n_kv_head": maps_to("num_key_value_heads"), "d_head": maps_to("head_dim"),
    "d_ff": maps_to("intermediate_size"), "max_len": maps_to("max_position_embeddings"),
    "rope_base": maps_to("rope_parameters.rope_theta"), "rope_scaling": maps_to("rope_parameters (rope_type and its keys)"),
    "norm_eps": maps_to("rms_norm_eps"),
    "attn_dropout": maps_to("attention_dropout"), "tie_embeddings": maps_to("tie_word_embeddings"),
    "init_std": maps_to("initializer_range"), "pad_token_id": maps_to("pad_token_id"), "valid_vocab": UNPADDED,
    "qkv_bias": maps_to("attention_bias (LLaMA) / always True (Qwen2)"),
    "o_bias": Field(lambda v, c: v == c.qkv_bias or (c.qkv_bias and not v and not c.mlp_bias),
                    "qkv_bias (LLaMA attention_bias), or False with qkv_bias=True and mlp_bias=False (Qwen2)"),
    "mlp_bias": maps_to("mlp_bias"),
    "pos": must_be("rope"), "rope_layout": must_be("half"), "norm": must_be("rmsnorm"),
    "norm_bias": unused("norm must be 'rmsnorm' (no bias)"), "mlp": must_be("swiglu"),
    "norm_placement": must_be("pre"), "final_norm": must_be(True), "dropout": must_be(0.0),
    "scale_out_init": must_be(False), "embed_scale": must_be(False), "residual": must_be("standard"),
    "lm_head_bias": must_be(False), "moe": must_be(None),
    "rotary_dim": Field(lambda v, c: v is None or v == c.head_dim, "None or head_dim (RoPE on the whole head)"),
    "parallel_residual": must_be(False), "qk_norm": must_be(None),
    "sliding_window": Field(lambda v, c: v is None or not c.mlp_bias and (not c.qkv_bias or not c.o_bias),
                            "-> sliding_window (Mistral: no biases; Qwen2: q/k/v biases)"),
    "window_layers": Field(lambda v, c: v is None or (c.qkv_bias and not c.o_bias and not c.mlp_bias),
                           "None (every layer slides), or Qwen2's q/k/v biases (-> layer_types)"),
    **ATTNRES_UNUSED, **ENGINE_UNUSED, **GEMMA_ONLY,
}

RULES = [
    (r"model\.embed_tokens\.weight", "tok_embed.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qk]_norm)\.weight", r"layers.\1.attn.\2.scale"),  # Qwen3, OLMo 2
    (r"model\.layers\.(\d+)\.self_attn\.(\w+)\.(\w+)", r"layers.\1.attn.\2.\3"),
    (r"model\.layers\.(\d+)\.mlp\.(\w+)\.(\w+)", r"layers.\1.mlp.\2.\3"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.scale"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.scale"),
    (r"model\.norm\.weight", "norm.scale"),
]


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF LLaMA / Qwen2 / Mistral config dict -> ModelConfig; every unsupported option named at once."""
    family = d.get("model_type", "llama")
    check_options(d, OPTIONS[family], NAMES[family])
    heads = d.get("num_attention_heads", 32)
    qkv, o, mlp = _BIASES[family] or (d.get("attention_bias", False),) * 2 + (d.get("mlp_bias", False),)
    window, window_layers = _window_layers({**d, "model_type": family})
    return ModelConfig(sliding_window=window, window_layers=window_layers,
        vocab_size=d.get("vocab_size", 32000), max_len=_context(d), d_model=d.get("hidden_size", 4096),
        n_layer=d.get("num_hidden_layers", 32), n_head=heads, n_kv_head=d.get("num_key_value_heads") or heads,
        d_head=_head_dim(d),
        d_ff=d.get("intermediate_size", 11008), pos="rope", rope_layout="half", rope_base=_rope(d)[1],
        rope_scaling=_rope(d)[0],
        norm="rmsnorm", norm_eps=d.get("rms_norm_eps", 1e-6), mlp="swiglu", mlp_bias=mlp, qkv_bias=qkv, o_bias=o,
        tie_embeddings=d.get("tie_word_embeddings", False), attn_dropout=d.get("attention_dropout", 0.0),
        init_std=d.get("initializer_range", 0.02), pad_token_id=padding_row(d))


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    def skip(key: str) -> bool:  # RoPE buffers of older checkpoints; a tied head is the embedding
        return key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)

    return load_ref(config, rename(tensors, RULES, skip=skip), template)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> an HF LLaMA config dict (Qwen2 when q/k/v have biases and o has none; Mistral
    for a sliding window without biases), or one ValueError naming every field none can express."""
    refuse(check_fields(config, FIELDS, "LLaMA"), "LLaMA")
    family = "qwen2" if config.qkv_bias and not config.o_bias else \
        "mistral" if config.sliding_window is not None else "llama"
    d = dict(model_type=family, architectures=[ARCHS[family]], vocab_size=config.vocab_size,
             hidden_size=config.d_model, intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layer,
             num_attention_heads=config.n_head, num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
             max_position_embeddings=config.max_len, rms_norm_eps=config.norm_eps, hidden_act="silu",
             rope_theta=config.rope_base, rope_scaling=None, rope_parameters=_rope_parameters(config),
             tie_word_embeddings=config.tie_embeddings, attention_dropout=config.attention_dropout,
             initializer_range=config.init_std, bos_token_id=None, eos_token_id=None,
             pad_token_id=config.pad_token_id)
    if family == "llama":
        d.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias, pretraining_tp=1)
    elif family == "mistral":
        d.update(sliding_window=config.sliding_window)
    else:
        sliding = [config.layer_window(i) is not None for i in range(config.n_layer)]
        first = sliding.index(True) if any(sliding) else config.n_layer
        # max_window_layers for transformers versions without layer_types: exact where the sliding layers are a suffix
        d.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                 max_window_layers=first, layer_types=[KINDS[s] for s in sliding])
    return d


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    if config.rope_scaling is None:
        return {"rope_theta": config.rope_base, "rope_type": "default"}
    return config.rope_scaling.to_hf(config.rope_base)


# torch_ref layer keys -> HF LLaMA's (q_norm / k_norm: Qwen3's and OLMo 2's); OLMo 2 renames the layer norms
NORMS = {"attn_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight",
         "attn.q_norm.scale": "attn.q_norm.weight", "attn.k_norm.scale": "attn.k_norm.weight"}


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray], norms: Mapping[str, str] = NORMS
                 ) -> dict[str, np.ndarray]:
    top = {"tok_embed.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}

    def layer(i, rest, a):
        for old, new in norms.items():
            rest = rest.replace(old, new)
        return f"model.layers.{i}.{rest.replace('attn.', 'self_attn.')}", a

    return rename_layers(ref, top, layer)
