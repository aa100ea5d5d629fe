"""External layouts -> the torch_ref layout -> Flax params (and back), as small key maps.

Each importer renames an external state dict into torch_ref's names (splitting packed q/k/v,
transposing HF's Conv1D), then the strict generic rule checks every key against the model's
abstract parameters. torch and transformers are imported lazily, inside the HF functions only.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.convert.rule import params_to_state_dict, state_dict_to_params, to_numpy
from jaxgpt.models import init_params, stacked_paths



def abstract_params(config) -> dict:
    """Parameter shapes (ShapeDtypeStructs) of ``build(config)`` for any config, without allocating."""
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def _rename(sd: Mapping[str, Any], rules: list[tuple[str, str]], skip: Callable[[str], bool] = lambda k: False):
    """Apply the first matching (regex, replacement) to every key; unmatched keys are kept as
    they are so the strict rule reports them as unexpected."""
    out = {}
    for key, value in sd.items():
        if skip(key):
            continue
        for pattern, repl in rules:
            if re.fullmatch(pattern, key):
                key = re.sub(pattern, repl, key)
                break
        out[key] = to_numpy(value)
    return out


def _split_packed(sd: dict, packed: str, sizes: tuple[int, int, int], axis: int) -> dict:
    """layers.{i}.attn.<packed>.{weight,bias} -> q_proj / k_proj / v_proj along ``axis``."""
    for key in [k for k in sd if f".attn.{packed}." in k]:
        a = sd.pop(key)
        leaf = key.rsplit(".", 1)[1]
        cut = np.cumsum(sizes)[:2]
        for name, part in zip(("q_proj", "k_proj", "v_proj"), np.split(a, cut, axis=axis if a.ndim == 2 else 0)):
            sd[key.replace(f"attn.{packed}.{leaf}", f"attn.{name}.{leaf}")] = part
    return sd


def _load(config: ModelConfig, sd: dict) -> dict:
    return state_dict_to_params(sd, abstract_params(config), stacked=stacked_paths(config))


# GPT-2 family: HF GPT2LMHeadModel, nanoGPT and seed 003 share one layout up to a prefix -----
_GPT_RULES = [(r"(?:transformer\.)?" + pattern, repl) for pattern, repl in [
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


def _is_mask_buffer(key: str) -> bool:
    # Causal-mask buffers saved by older GPT-2 / nanoGPT / seed 003 code: not parameters.
    return bool(re.search(r"\.attn\.(bias|masked_bias|mask)$", key))


def _gpt_to_ref(sd: Mapping[str, Any], config: ModelConfig, conv1d: bool) -> dict:
    ref = _rename(sd, _GPT_RULES, skip=lambda k: _is_mask_buffer(k) or (k == "lm_head.weight" and config.tie_embeddings))
    if conv1d:  # HF's Conv1D stores (in, out): make it torch Linear's (out, in)
        for k in [k for k in ref if k.endswith(".weight") and ref[k].ndim == 2 and k.startswith("layers.")]:
            ref[k] = np.ascontiguousarray(ref[k].T)
    return _split_packed(ref, "c_attn", (config.d_model,) * 3, axis=0)


def _ref_to_gpt(ref: Mapping[str, np.ndarray], config: ModelConfig) -> dict:
    """torch_ref layout -> HF GPT2LMHeadModel state dict (Conv1D weights are (in, out))."""
    inverse = {"tok_embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
               "norm.scale": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    names = {"attn_norm.scale": "ln_1.weight", "attn_norm.bias": "ln_1.bias", "mlp_norm.scale": "ln_2.weight",
             "mlp_norm.bias": "ln_2.bias", "attn.o_proj": "attn.c_proj", "mlp.fc_in": "mlp.c_fc",
             "mlp.fc_out": "mlp.c_proj"}
    out = {}
    for key, a in ref.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if not m:
            out[inverse[key]] = a
            continue
        i, rest = m.groups()
        if rest.startswith(("attn.q_proj", "attn.k_proj", "attn.v_proj")):
            continue
        for old, new in names.items():
            rest = rest.replace(old, new)
        out[f"transformer.h.{i}.{rest}"] = a.T if a.ndim == 2 else a
    for i in range(config.n_layer):
        for leaf in ("weight", "bias"):
            parts = [ref[f"layers.{i}.attn.{n}.{leaf}"] for n in ("q_proj", "k_proj", "v_proj")]
            out[f"transformer.h.{i}.attn.c_attn.{leaf}"] = np.concatenate(parts, 0).T if leaf == "weight" else np.concatenate(parts)
    out["lm_head.weight"] = ref["tok_embed.weight"]
    return out


def gpt2_config(hf_config) -> ModelConfig:
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
    if hf_config.activation_function not in acts:
        raise ValueError(f"unsupported GPT-2 activation {hf_config.activation_function!r}; supported: {sorted(acts)}")
    return ModelConfig(
        vocab_size=hf_config.vocab_size, max_len=hf_config.n_positions, d_model=hf_config.n_embd,
        n_layer=hf_config.n_layer, n_head=hf_config.n_head, d_ff=hf_config.n_inner, pos="learned",
        norm="layernorm", norm_eps=hf_config.layer_norm_epsilon, mlp=acts[hf_config.activation_function],
        mlp_bias=True, qkv_bias=True, o_bias=True, tie_embeddings=True, dropout=hf_config.resid_pdrop,
        attn_dropout=hf_config.attn_pdrop, scale_out_init=True)


def from_nanogpt(checkpoint: str | Mapping[str, Any]) -> tuple[ModelConfig, dict]:
    """A nanoGPT ``ckpt.pt`` (path or loaded dict with 'model_args' and 'model') -> (config, params).

    Handles torch.compile's ``_orig_mod.`` prefix and bias=True/False models; nanoGPT uses
    torch's exact GELU, LayerNorm eps 1e-5 and a tied head.
    """
    if isinstance(checkpoint, str):
        import torch

        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=False)
    missing = [k for k in ("model_args", "model") if k not in checkpoint]
    if missing:
        raise ValueError(f"not a nanoGPT checkpoint: missing {missing} (keys: {sorted(checkpoint)})")
    args = checkpoint["model_args"]
    bias = args.get("bias", True)
    config = ModelConfig(
        vocab_size=args["vocab_size"], max_len=args["block_size"], d_model=args["n_embd"], n_layer=args["n_layer"],
        n_head=args["n_head"], pos="learned", norm="layernorm", norm_eps=1e-5, norm_bias=bias, mlp="gelu",
        mlp_bias=bias, qkv_bias=bias, o_bias=bias, tie_embeddings=True, dropout=args.get("dropout", 0.0),
        attn_dropout=args.get("dropout", 0.0), scale_out_init=True)
    sd = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
    return config, _load(config, _gpt_to_ref(sd, config, conv1d=False))


def from_seed_gpt(state_dict: Mapping[str, Any], config: ModelConfig) -> dict:
    """Seed 003's GPT (wte, wpe, h.{i}.attn.c_attn packed Linear, ..., tied lm_head) -> params.
    ``config``: e.g. PRESETS['gpt2-shakespeare-char'] with the seed's vocab_size."""
    return _load(config, _gpt_to_ref(state_dict, config, conv1d=False))


# LLaMA: HF LlamaForCausalLM ---------------------------------------------------------------
_LLAMA_RULES = [
    (r"model\.embed_tokens\.weight", "tok_embed.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(\w+)\.(\w+)", r"layers.\1.attn.\2.\3"),
    (r"model\.layers\.(\d+)\.mlp\.(\w+)\.(\w+)", r"layers.\1.mlp.\2.\3"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.scale"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.scale"),
    (r"model\.norm\.weight", "norm.scale"),
]


def llama_config(hf_config) -> ModelConfig:
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported LLaMA rope_type {rope['rope_type']!r}; only 'default' RoPE is implemented")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        raise ValueError(f"head_dim={head_dim} x {hf_config.num_attention_heads} heads != hidden_size={hf_config.hidden_size}")
    return ModelConfig(
        vocab_size=hf_config.vocab_size, max_len=hf_config.max_position_embeddings, d_model=hf_config.hidden_size,
        n_layer=hf_config.num_hidden_layers, n_head=hf_config.num_attention_heads,
        n_kv_head=hf_config.num_key_value_heads, d_ff=hf_config.intermediate_size, pos="rope", rope_layout="half",
        rope_base=float(rope["rope_theta"]), norm="rmsnorm", norm_eps=hf_config.rms_norm_eps, mlp="swiglu",
        mlp_bias=hf_config.mlp_bias, qkv_bias=hf_config.attention_bias, o_bias=hf_config.attention_bias,
        tie_embeddings=hf_config.tie_word_embeddings, attn_dropout=hf_config.attention_dropout)


def _ref_to_llama(ref: Mapping[str, np.ndarray]) -> dict:
    inverse = {"tok_embed.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
    out = {}
    for key, a in ref.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if not m:
            out[inverse[key]] = a
            continue
        i, rest = m.groups()
        rest = (rest.replace("attn_norm.scale", "input_layernorm.weight")
                .replace("mlp_norm.scale", "post_attention_layernorm.weight").replace("attn.", "self_attn."))
        out[f"model.layers.{i}.{rest}"] = a
    return out


# Seed 000 MiniGPT -------------------------------------------------------------------------
_SEED000_RULES = [
    (r"token_emb\.weight", "tok_embed.weight"),
    (r"layers\.(\d+)\.norm1\.weight", r"layers.\1.attn_norm.scale"),
    (r"layers\.(\d+)\.norm2\.weight", r"layers.\1.mlp_norm.scale"),
    (r"layers\.(\d+)\.attn\.W_([qkvo])\.weight", r"layers.\1.attn.\2_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w_(gate|up|down)\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"layers\.(\d+)\.ffn\.w1\.(\w+)", r"layers.\1.mlp.fc_in.\2"),
    (r"layers\.(\d+)\.ffn\.w2\.(\w+)", r"layers.\1.mlp.fc_out.\2"),
    (r"norm\.weight", "norm.scale"),
]


def from_seed_minigpt(state_dict: Mapping[str, Any], config: ModelConfig) -> dict:
    """Seed 000's MiniGPT state dict -> params. ``config``: PRESETS['seed-minigpt'] (or an
    ablation preset) with the seed's vocab_size / max_len. The sinusoidal buffer is not a weight."""
    return _load(config, _rename(state_dict, _SEED000_RULES, skip=lambda k: k == "pos_enc.pe"))


# HuggingFace entry points -------------------------------------------------------------------
def from_hf(hf_model) -> tuple[Any, dict]:
    """A transformers model (GPT2LMHeadModel, LlamaForCausalLM, BertModel,
    BertForSequenceClassification) -> (jaxgpt config, params)."""
    name = type(hf_model).__name__
    if name.startswith("GPT2"):
        config = gpt2_config(hf_model.config)
        sd = {k.removeprefix("transformer.") if name == "GPT2Model" else k: v for k, v in hf_model.state_dict().items()}
        return config, _load(config, _gpt_to_ref(sd, config, conv1d=True))
    if name.startswith("Llama"):
        config = llama_config(hf_model.config)
        sd = hf_model.state_dict()
        if config.tie_embeddings:
            sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        return config, _load(config, _rename(sd, _LLAMA_RULES))
    if name.startswith("Bert"):
        from jaxgpt.convert.bert import from_hf_bert

        return from_hf_bert(hf_model)
    raise ValueError(f"from_hf supports GPT2LMHeadModel, LlamaForCausalLM and BERT models, got {name}")


def to_hf(config, params):
    """jaxgpt (config, params) -> a transformers model holding the same weights (eval mode)."""
    import torch

    from jaxgpt.config import BertConfig

    if isinstance(config, BertConfig):
        from jaxgpt.convert.bert import to_hf_bert

        return to_hf_bert(config, params)
    ref = params_to_state_dict(params, stacked=stacked_paths(config))
    if config.pos == "learned" and config.norm == "layernorm" and config.tie_embeddings:
        from transformers import GPT2Config, GPT2LMHeadModel

        acts = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
        hf = GPT2LMHeadModel(GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.d_model, n_layer=config.n_layer,
            n_head=config.n_head, n_inner=config.ffn_dim, activation_function=acts[config.mlp],
            layer_norm_epsilon=config.norm_eps, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
            attn_pdrop=config.attn_dropout))
        sd = _ref_to_gpt(ref, config)
    elif config.pos == "rope" and config.mlp == "swiglu" and config.rope_layout == "half":
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_dim,
            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
            num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_len,
            rms_norm_eps=config.norm_eps, rope_parameters={"rope_theta": config.rope_base, "rope_type": "default"},
            tie_word_embeddings=config.tie_embeddings, attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias))
        sd = _ref_to_llama(ref)
        if config.tie_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        raise ValueError("to_hf exports GPT-2-style (learned, layernorm, tied) and LLaMA-style (rope half, swiglu) "
                         f"decoders; this config has pos={config.pos!r}, norm={config.norm!r}, mlp={config.mlp!r}")
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return hf.eval()
