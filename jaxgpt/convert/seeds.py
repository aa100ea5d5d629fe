"""The seeds' own models -> jaxgpt params, through the torch_ref layout and the strict rule.

- seed 000 MiniGPT (``from_seed_minigpt``), seed 003 GPT (``from_seed_gpt``, the GPT-2 layout);
- seed 002 Standard / Full / Block AttnRes transformers (``from_seed_attnres``):
    embed.weight, norm.weight, head.weight     ->  tok_embed.weight, norm.scale, lm_head.weight
    layers.{i}.norm_attn.weight / norm_mlp     ->  layers.{i}.attn_norm.scale / mlp_norm.scale
    layers.{i}.attn.qkv.weight (3d, d)         ->  attn.q_proj / k_proj / v_proj.weight (rows in thirds)
    layers.{i}.attn.out.weight                 ->  attn.o_proj.weight
    layers.{i}.mlp.net.0.weight / net.2.weight ->  mlp.fc_in.weight / fc_out.weight
    layers.{i}.w_attn, w_mlp, key_norm.weight  ->  w_attn, w_mlp, key_norm.scale (AttnRes: layers.layers.{i}.…)
- seed 004 MiniBert (``from_seed_minibert``).
Torch is never imported: tensors are read through ``to_numpy``.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from jaxgpt.config import PRESETS, BertConfig, ModelConfig, get_preset
from jaxgpt.convert import gpt2
from jaxgpt.convert.bert import rename_modules
from jaxgpt.convert.common import load_ref, rename
from jaxgpt.convert.rule import to_numpy

# Seed 000 MiniGPT ---------------------------------------------------------------------------
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
    return load_ref(config, rename(state_dict, _SEED000_RULES, skip=lambda k: k == "pos_enc.pe"))


# Seed 003 GPT -------------------------------------------------------------------------------
def from_seed_gpt(state_dict: Mapping[str, Any], config: ModelConfig) -> dict:
    """Seed 003's GPT (wte, wpe, h.{i}.attn.c_attn packed Linear, ..., tied lm_head) -> params.
    ``config``: e.g. PRESETS['gpt2-shakespeare-char'] with the seed's vocab_size."""
    return load_ref(config, gpt2.to_ref(state_dict, config, conv1d=False))


# Seed 002 AttnRes ---------------------------------------------------------------------------
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


def seed_attnres_config(state_dict: Mapping[str, Any], kind: str, *, n_head: int = 4,
                        attnres_blocks: int = 3) -> ModelConfig:
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


def _attnres_to_ref(state_dict: Mapping[str, Any], kind: str) -> dict:
    """Seed keys -> torch_ref DecoderLM keys; unknown keys are kept so the strict rule names them."""
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
    config = seed_attnres_config(state_dict, kind, n_head=n_head, attnres_blocks=attnres_blocks)
    return config, load_ref(config, _attnres_to_ref(state_dict, kind))


# Seed 004 MiniBert --------------------------------------------------------------------------
_MINIBERT_LAYER = {"attn.q_proj": "attn.q_proj", "attn.k_proj": "attn.k_proj", "attn.v_proj": "attn.v_proj",
                   "attn.out_proj": "attn.o_proj", "norm1": "attn_norm", "ffn.fc1": "mlp.fc_in",
                   "ffn.fc2": "mlp.fc_out", "norm2": "mlp_norm"}
_MINIBERT_TOP = {"token_emb": "tok_embed", "pos_emb": "pos_embed", "norm": "norm", "classifier": "classifier"}


def from_seed_minibert(state_dict: Mapping[str, Any], config: BertConfig | None = None, *,
                       n_head: int = 4) -> tuple[BertConfig, dict]:
    """(BertConfig, params) from seed 004's ``MiniBert(...).state_dict()``.

    Sizes (vocab, d_model, max_len, n_layer, d_ff, n_classes) are read from the shapes; the head
    count is not in the weights: ``n_head`` (the seed's default is 4) unless ``config`` is given.
    """
    sd = {k: to_numpy(v) for k, v in state_dict.items()}
    for key in ("token_emb.weight", "pos_emb.weight", "layers.0.ffn.fc1.weight", "classifier.weight"):
        if key not in sd:
            raise ValueError(f"not a seed MiniBert state dict: {key!r} is missing (keys: {sorted(sd)[:8]}...)")
    if config is None:
        vocab, d = sd["token_emb.weight"].shape
        n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
        base = PRESETS["seed-minibert"]
        encoder = base.encoder.replace(vocab_size=vocab, d_model=d, n_head=n_head, n_layer=n_layer,
                                       d_ff=sd["layers.0.ffn.fc1.weight"].shape[0],
                                       max_len=sd["pos_emb.weight"].shape[0])
        config = base.replace(encoder=encoder, n_classes=sd["classifier.weight"].shape[0])
    return config, load_ref(config, rename_modules(sd, _MINIBERT_TOP, _MINIBERT_LAYER, "layers"))
