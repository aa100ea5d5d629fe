"""BERT weights into and out of jaxgpt's BertClassifier: Hugging Face ``transformers`` BERT and the
seed 004 MiniBERT state dict.

Both directions go through torch_ref's key names (the generic rule of jaxgpt.convert, with the
encoder layers stacked under ``layers``), so every conversion is strict: missing, unexpected and
mis-shaped keys are named in one ValueError. torch / transformers are imported inside functions only.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import PRESETS, BertConfig, ModelConfig
from jaxgpt.convert.external import abstract_params
from jaxgpt.convert.rule import params_to_state_dict, state_dict_to_params, to_numpy
from jaxgpt.models import stacked_paths

_HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# torch_ref key (with {i} for the layer) <-> HF BertModel key. LayerNorm weight <-> our ``scale``.
_HF_LAYER = {
    "attn.q_proj": "attention.self.query", "attn.k_proj": "attention.self.key",
    "attn.v_proj": "attention.self.value", "attn.o_proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm", "mlp.fc_in": "intermediate.dense",
    "mlp.fc_out": "output.dense", "mlp_norm": "output.LayerNorm",
}
_HF_TOP = {"tok_embed": "embeddings.word_embeddings", "pos_embed": "embeddings.position_embeddings",
           "type_embed": "embeddings.token_type_embeddings", "embed_norm": "embeddings.LayerNorm",
           "pooler": "pooler.dense"}
# seed 004 MiniBert module names -> torch_ref names.
_SEED_LAYER = {"attn.q_proj": "attn.q_proj", "attn.k_proj": "attn.k_proj", "attn.v_proj": "attn.v_proj",
               "attn.out_proj": "attn.o_proj", "norm1": "attn_norm", "ffn.fc1": "mlp.fc_in",
               "ffn.fc2": "mlp.fc_out", "norm2": "mlp_norm"}
_SEED_TOP = {"token_emb": "tok_embed", "pos_emb": "pos_embed", "norm": "norm", "classifier": "classifier"}
_IS_NORM = re.compile(r"(^|\.)(norm|attn_norm|mlp_norm|embed_norm)$")


def _rename(sd: Mapping[str, Any], top: Mapping[str, str], layer: Mapping[str, str],
            src_layers: str) -> dict[str, Any]:
    """Foreign keys -> torch_ref keys: module prefixes renamed by ``top`` and (inside
    ``{src_layers}.{i}.``) by ``layer``; a norm's ``weight`` becomes ``scale``. Keys matching
    nothing are kept as they are, so strict loading reports them."""
    out = {}
    pat = re.compile(rf"^{re.escape(src_layers)}\.(\d+)\.(.+)$")
    for key, v in sd.items():
        mod, _, leaf = key.rpartition(".")
        m = pat.match(mod)
        if m and m.group(2) in layer:
            mod = f"layers.{m.group(1)}.{layer[m.group(2)]}"
        elif mod in top:
            mod = top[mod]
        else:
            out[key] = v
            continue
        if leaf == "weight" and _IS_NORM.search(mod):
            leaf = "scale"
        out[f"{mod}.{leaf}"] = v
    return out


def _hf_to_ours(sd: Mapping[str, Any]) -> dict[str, Any]:
    return _rename(sd, {v: k for k, v in _HF_TOP.items()}, {v: k for k, v in _HF_LAYER.items()},
                   "encoder.layer")


def _ours_to_hf(sd: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, v in sd.items():
        mod, _, leaf = key.rpartition(".")
        if leaf == "scale":
            leaf = "weight"
        m = re.match(r"^layers\.(\d+)\.(.+)$", mod)
        if m:
            mod = f"bert.encoder.layer.{m.group(1)}.{_HF_LAYER[m.group(2)]}"
        elif mod in _HF_TOP:
            mod = f"bert.{_HF_TOP[mod]}"
        out[f"{mod}.{leaf}"] = v
    return out


def from_hf_bert(hf_model) -> tuple[BertConfig, dict]:
    """(BertConfig, params) from a ``transformers`` BertModel or BertForSequenceClassification.

    A bare BertModel has no classifier: its params hold everything else (use BertClassifier.encode,
    or add a ``classifier`` {kernel (d, n_classes), bias} before calling the model).
    """
    hc = hf_model.config
    if hc.hidden_act not in _HF_ACT:
        raise ValueError(f"hidden_act={hc.hidden_act!r} is not supported; expected one of {sorted(_HF_ACT)}")
    pos_type = getattr(hc, "position_embedding_type", None) or "absolute"
    if pos_type != "absolute":
        raise ValueError(f"position_embedding_type={pos_type!r} is not supported; expected 'absolute'")
    sd = {k: to_numpy(v) for k, v in hf_model.state_dict().items() if k in dict(hf_model.named_parameters())}
    has_head = any(k.startswith("bert.") for k in sd)
    if has_head:
        sd = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in sd.items()}
    encoder = ModelConfig(
        vocab_size=hc.vocab_size, d_model=hc.hidden_size, n_layer=hc.num_hidden_layers,
        n_head=hc.num_attention_heads, d_ff=hc.intermediate_size, max_len=hc.max_position_embeddings,
        pos="learned", norm="layernorm", norm_eps=hc.layer_norm_eps, mlp=_HF_ACT[hc.hidden_act],
        mlp_bias=True, qkv_bias=True, o_bias=True, norm_placement="post", final_norm=False,
        dropout=hc.hidden_dropout_prob, attn_dropout=hc.attention_probs_dropout_prob, init_std=hc.initializer_range)
    has_pooler = "pooler.dense.weight" in sd
    config = BertConfig(encoder, n_classes=hc.num_labels, type_vocab_size=hc.type_vocab_size, embed_norm=True,
                        pooler="tanh" if has_pooler else "cls")
    template = abstract_params(config)
    if not has_head:
        template = {k: v for k, v in template.items() if k != "classifier"}
    return config, state_dict_to_params(_hf_to_ours(sd), template, stacked=stacked_paths(config))


def to_hf_bert(config: BertConfig, params: Mapping, *, attn_implementation: str = "eager"):
    """A ``transformers.BertForSequenceClassification`` (eval mode) holding ``params``.

    Needs the BERT layout: learned positions, Post-LN LayerNorm, no final norm, an embedding
    LayerNorm, token-type embeddings, a tanh pooler, biases everywhere and no GQA.
    """
    import torch
    import transformers

    enc = config.encoder
    inverse_act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
    needs = {"encoder.pos": (enc.pos, "learned"), "encoder.norm": (enc.norm, "layernorm"),
             "encoder.norm_placement": (enc.norm_placement, "post"), "encoder.final_norm": (enc.final_norm, False),
             "encoder.residual": (enc.residual, "standard"), "encoder.embed_scale": (enc.embed_scale, False),
             "encoder.n_kv_head": (enc.kv_heads, enc.n_head), "embed_norm": (config.embed_norm, True),
             "pooler": (config.pooler, "tanh"), "encoder.norm_bias": (enc.norm_bias, True)}
    for flag in ("mlp_bias", "qkv_bias", "o_bias"):
        needs[f"encoder.{flag}"] = (getattr(enc, flag), True)
    for name, (got, want) in needs.items():
        if got != want:
            raise ValueError(f"HF BERT needs {name}={want!r}, got {got!r}")
    if enc.mlp not in inverse_act:
        raise ValueError(f"HF BERT needs encoder.mlp in {sorted(inverse_act)}, got {enc.mlp!r}")
    if config.type_vocab_size <= 0:
        raise ValueError(f"HF BERT needs type_vocab_size > 0, got {config.type_vocab_size}")
    hc = transformers.BertConfig(
        vocab_size=enc.vocab_size, hidden_size=enc.d_model, num_hidden_layers=enc.n_layer,
        num_attention_heads=enc.n_head, intermediate_size=enc.ffn_dim, hidden_act=inverse_act[enc.mlp],
        max_position_embeddings=enc.max_len, type_vocab_size=config.type_vocab_size,
        layer_norm_eps=enc.norm_eps, hidden_dropout_prob=enc.dropout, attention_probs_dropout_prob=enc.attn_dropout,
        initializer_range=enc.init_std, num_labels=config.n_classes, attn_implementation=attn_implementation)
    model = transformers.BertForSequenceClassification(hc)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v))
          for k, v in _ours_to_hf(params_to_state_dict(params, stacked=stacked_paths(config))).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    buffers = {k for k, _ in model.named_buffers()}
    missing = [k for k in missing if k not in buffers]
    if missing or unexpected:
        raise ValueError(f"params do not match HF BERT: missing {missing}, unexpected {list(unexpected)}")
    return model.eval()


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
    ours = _rename(sd, _SEED_TOP, _SEED_LAYER, "layers")
    return config, state_dict_to_params(ours, abstract_params(config), stacked=stacked_paths(config))
