"""Seed 002's StandardTransformer / FullAttnResTransformer / BlockAttnResTransformer state dicts
-> (ModelConfig, jaxgpt params), via the torch_ref layout and the strict generic rule.

Seed keys                                      torch_ref keys (AttnRes: layers.layers.{i}.…)
embed.weight, norm.weight, head.weight     ->  tok_embed.weight, norm.scale, lm_head.weight
layers.{i}.norm_attn.weight / norm_mlp     ->  layers.{i}.attn_norm.scale / mlp_norm.scale
layers.{i}.attn.qkv.weight (3d, d)         ->  attn.q_proj / k_proj / v_proj.weight (rows split in thirds)
layers.{i}.attn.out.weight                 ->  attn.o_proj.weight
layers.{i}.mlp.net.0.weight / net.2.weight ->  mlp.fc_in.weight / fc_out.weight
layers.{i}.w_attn, w_mlp, key_norm.weight  ->  w_attn, w_mlp, key_norm.scale
Torch is never imported: tensors are read through ``to_numpy``.
"""
from __future__ import annotations

import re
from typing import Any, Mapping


from jaxgpt.config import ModelConfig, get_preset
from jaxgpt.convert.external import abstract_params
from jaxgpt.convert.rule import state_dict_to_params, to_numpy
from jaxgpt.models import stacked_paths

SEED_PRESETS = {"standard": "seed-attnres-standard", "full": "seed-attnres-full", "block": "seed-attnres-block"}

_LAYER_RULES = [
    (r"norm_attn\.weight", "attn_norm.scale"),
    (r"norm_mlp\.weight", "mlp_norm.scale"),
    (r"attn\.out\.weight", "attn.o_proj.weight"),
    (r"mlp\.net\.0\.weight", "mlp.fc_in.weight"),
    (r"mlp\.net\.2\.weight", "mlp.fc_out.weight"),
    (r"key_norm\.weight", "key_norm.scale"),
    (r"(w_attn|w_mlp)", r"\1"),
]
_TOP = {"embed.weight": "tok_embed.weight", "norm.weight": "norm.scale", "head.weight": "lm_head.weight"}


def seed_config(state_dict: Mapping[str, Any], kind: str, *, n_head: int = 4, attnres_blocks: int = 3) -> ModelConfig:
    """The 'seed-attnres-{kind}' preset resized to the state dict (vocab, d_model, n_layer, d_ff).
    n_head and the seed's n_blocks are not stored in the weights: pass the constructor's values."""
    if kind not in SEED_PRESETS:
        raise ValueError(f"kind={kind!r} is not one of {tuple(SEED_PRESETS)}")
    vocab, d = to_numpy(state_dict["embed.weight"]).shape
    n_layer = len({m.group(1) for k in state_dict if (m := re.match(r"layers\.(\d+)\.", k))})
    d_ff = to_numpy(state_dict["layers.0.mlp.net.0.weight"]).shape[0]
    changes = dict(vocab_size=vocab, d_model=d, n_layer=n_layer, n_head=n_head, d_ff=d_ff)
    if kind == "block":
        changes["attnres_blocks"] = attnres_blocks
    return get_preset(SEED_PRESETS[kind]).replace(**changes)


def seed_to_ref(state_dict: Mapping[str, Any], kind: str) -> dict:
    """Seed keys -> torch_ref DecoderLM keys (NumPy arrays). Unknown keys are kept as they are,
    so the strict rule names them as unexpected."""
    out = {}
    prefix = "layers" if kind == "standard" else "layers.layers"
    for key, value in state_dict.items():
        a = to_numpy(value)
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if key in _TOP:
            out[_TOP[key]] = a
        elif m and m.group(2) == "attn.qkv.weight":
            q, k, v = a.reshape(3, a.shape[0] // 3, a.shape[1])  # rows [q; k; v], heads major inside
            for name, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{prefix}.{m.group(1)}.attn.{name}.weight"] = w
        elif m and any(re.fullmatch(p, m.group(2)) for p, _ in _LAYER_RULES):
            rest = next(re.sub(p, r, m.group(2)) for p, r in _LAYER_RULES if re.fullmatch(p, m.group(2)))
            out[f"{prefix}.{m.group(1)}.{rest}"] = a
        else:
            out[key] = a
    return out


def from_seed_attnres(state_dict: Mapping[str, Any], kind: str, *, n_head: int = 4,
                      attnres_blocks: int = 3) -> tuple[ModelConfig, dict]:
    """Seed 002 model state dict -> (config, params) for jaxgpt's DecoderLM.

    kind: 'standard' (params in the scanned Block layout: per-layer leaves stacked under
    ``layers``), 'full' or 'block' (AttnRes layers ``layers/layers_{i}``, variant 'seed').
    n_head / attnres_blocks: the seed constructor's n_heads / n_blocks (main() uses 4 and 3).
    """
    config = seed_config(state_dict, kind, n_head=n_head, attnres_blocks=attnres_blocks)
    return config, state_dict_to_params(seed_to_ref(state_dict, kind), abstract_params(config),
                                        stacked=stacked_paths(config))
