"""Hugging Face BERT (BertModel, BertForSequenceClassification) <-> jaxgpt's BertClassifier.

HF key (BertForSequenceClassification adds the ``bert.`` prefix)   torch_ref key
embeddings.{word,position,token_type}_embeddings / LayerNorm   <-> tok_embed / pos_embed / type_embed / embed_norm
encoder.layer.{i}.attention.self.{query,key,value}             <-> layers.{i}.attn.{q,k,v}_proj
encoder.layer.{i}.attention.output.dense / LayerNorm           <-> layers.{i}.attn.o_proj / attn_norm
encoder.layer.{i}.intermediate.dense / output.dense / LayerNorm <-> layers.{i}.mlp.fc_in / fc_out / mlp_norm
pooler.dense, classifier                                       <-> pooler, classifier
A bare BertModel gives a BertConfig whose params have no ``classifier`` (BertClassifier.encode
runs them; add a classifier {kernel (d, n_classes), bias} before calling the model).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from jaxgpt.config import BertConfig, ModelConfig
from jaxgpt.convert.common import (ATTNRES_UNUSED, ENGINE_UNUSED, GEMMA_ONLY, MAPPED, Field, Option, check_fields, check_options, equals, inert,
                                   load_ref, maps_to, must_be, one_of, padding_row, refuse, unused)
from jaxgpt.models import abstract_params

ARCHS = ("BertModel", "BertForSequenceClassification")
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
DEFAULTS = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                max_position_embeddings=512, type_vocab_size=2, initializer_range=0.02, layer_norm_eps=1e-12)

OPTIONS: dict[str, Option] = {
    **{k: MAPPED for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "hidden_dropout_prob", "attention_probs_dropout_prob",
                           "max_position_embeddings", "type_vocab_size", "initializer_range", "layer_norm_eps",
                           "pad_token_id",
                           "num_labels", "id2label")},
    "hidden_act": one_of(ACTS),
    "position_embedding_type": equals("absolute", None),
    "is_decoder": equals(False),
    # jaxgpt's classifier dropout is the encoder's dropout rate.
    "classifier_dropout": Option(lambda v, d: v is None or v == d.get("hidden_dropout_prob", 0.1),
                                 "None or hidden_dropout_prob"),
    "problem_type": equals(None, "single_label_classification"),
    "tie_word_embeddings": inert("ties the masked-LM head, which these models do not have"),
}

_ENCODER: dict[str, Field] = {
    "vocab_size": maps_to("vocab_size"), "d_model": maps_to("hidden_size"), "n_layer": maps_to("num_hidden_layers"),
    "n_head": maps_to("num_attention_heads"), "d_ff": maps_to("intermediate_size"),
    "max_len": maps_to("max_position_embeddings"), "norm_eps": maps_to("layer_norm_eps"),
    "dropout": maps_to("hidden_dropout_prob"), "attn_dropout": maps_to("attention_probs_dropout_prob"),
    "init_std": maps_to("initializer_range"), "pad_token_id": maps_to("pad_token_id"),
    "valid_vocab": unused("BertConfig itself refuses a padded encoder vocabulary"),
    "n_kv_head": Field(lambda v, c: v is None or v == c.n_head, "None or n_head (no GQA)"),
    "d_head": Field(lambda v, c: v is None or v * c.n_head == c.d_model, "None or d_model // n_head"),
    "sliding_window": unused("BertConfig itself refuses an encoder window (it attends both ways)"),
    "window_layers": unused("sliding_window must be None"),
    "pos": must_be("learned"), "rope_base": unused("pos must be 'learned'"),
    "rope_scaling": unused("pos must be 'learned'"),
    "rope_layout": unused("pos must be 'learned'"), "norm": must_be("layernorm"), "norm_bias": must_be(True),
    "mlp": Field(lambda v, c: v in _ACT_OUT, f"one of {sorted(_ACT_OUT)}"), "mlp_bias": must_be(True),
    "qkv_bias": must_be(True), "o_bias": must_be(True), "norm_placement": must_be("post"),
    "final_norm": must_be(False), "tie_embeddings": unused("no language-model head"),
    "lm_head_bias": unused("no language-model head"),
    "scale_out_init": must_be(False), "embed_scale": must_be(False), "residual": must_be("standard"),
    "moe": unused("BertConfig itself refuses encoder.moe (no MoE encoder)"),
    "rotary_dim": unused("pos must be 'learned'"), "parallel_residual": must_be(False), "qk_norm": must_be(None),
    **ATTNRES_UNUSED, **ENGINE_UNUSED, **GEMMA_ONLY,
}
FIELDS: dict[str, Field] = {
    "encoder": Field(lambda v, c: True, "see encoder.*"), "n_classes": maps_to("num_labels"),
    "type_vocab_size": Field(lambda v, c: v > 0, "> 0 (token-type embeddings)"), "embed_norm": must_be(True),
    "pooler": must_be("tanh"),
}

_LAYER = {
    "attn.q_proj": "attention.self.query", "attn.k_proj": "attention.self.key",
    "attn.v_proj": "attention.self.value", "attn.o_proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm", "mlp.fc_in": "intermediate.dense",
    "mlp.fc_out": "output.dense", "mlp_norm": "output.LayerNorm",
}
_TOP = {"tok_embed": "embeddings.word_embeddings", "pos_embed": "embeddings.position_embeddings",
        "type_embed": "embeddings.token_type_embeddings", "embed_norm": "embeddings.LayerNorm",
        "pooler": "pooler.dense"}
_IS_NORM = re.compile(r"(^|\.)(norm|attn_norm|mlp_norm|embed_norm)$")


def rename_modules(sd: Mapping[str, Any], top: Mapping[str, str], layer: Mapping[str, str],
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


def _n_classes(d: Mapping[str, Any]) -> int:
    return len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)


def config_from_hf(d: Mapping[str, Any], arch: str, has_pooler: bool = True) -> BertConfig:
    """An HF BERT config dict -> BertConfig; every unsupported option named in one ValueError.
    ``has_pooler``: whether the weights hold pooler.dense (BertModel(add_pooling_layer=False) has none)."""
    check_options(d, OPTIONS, "BERT")
    d = {**DEFAULTS, **d}
    encoder = ModelConfig(
        vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layer=d["num_hidden_layers"],
        n_head=d["num_attention_heads"], d_ff=d["intermediate_size"], max_len=d["max_position_embeddings"],
        pos="learned", norm="layernorm", norm_eps=d["layer_norm_eps"], mlp=ACTS[d["hidden_act"]], mlp_bias=True,
        qkv_bias=True, o_bias=True, norm_placement="post", final_norm=False, dropout=d["hidden_dropout_prob"],
        attn_dropout=d["attention_probs_dropout_prob"], init_std=d["initializer_range"],
        pad_token_id=padding_row(d, 0))  # BertConfig's default pad_token_id is 0
    return BertConfig(encoder, n_classes=_n_classes(d), type_vocab_size=d["type_vocab_size"], embed_norm=True,
                      pooler="tanh" if has_pooler else "cls")


def _is_buffer(key: str) -> bool:
    return key.endswith(("embeddings.position_ids", "embeddings.token_type_ids"))


def params_from_hf(config: BertConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    sd = {k.removeprefix("bert."): v for k, v in tensors.items() if not _is_buffer(k)}
    template = abstract_params(config) if template is None else template
    if arch == "BertModel":
        template = {k: v for k, v in template.items() if k != "classifier"}
    return load_ref(config, rename_modules(sd, {v: k for k, v in _TOP.items()}, {v: k for k, v in _LAYER.items()},
                                           "encoder.layer"), template)


def config_to_hf(config: BertConfig, with_classifier: bool = True) -> dict[str, Any]:
    """BertConfig -> HF BERT config dict (BertForSequenceClassification, or BertModel for params
    without a classifier), or one ValueError naming every field HF BERT cannot express."""
    problems = check_fields(config, FIELDS, "BERT") + check_fields(config.encoder, _ENCODER, "BERT", "encoder.")
    refuse(problems, "BERT")
    enc = config.encoder
    return dict(model_type="bert", architectures=["BertForSequenceClassification" if with_classifier else "BertModel"],
                vocab_size=enc.vocab_size, hidden_size=enc.d_model, num_hidden_layers=enc.n_layer,
                num_attention_heads=enc.n_head, intermediate_size=enc.ffn_dim, hidden_act=_ACT_OUT[enc.mlp],
                max_position_embeddings=enc.max_len, type_vocab_size=config.type_vocab_size,
                layer_norm_eps=enc.norm_eps, hidden_dropout_prob=enc.dropout,
                attention_probs_dropout_prob=enc.attention_dropout, initializer_range=enc.init_std,
                id2label={str(i): f"LABEL_{i}" for i in range(config.n_classes)},
                label2id={f"LABEL_{i}": i for i in range(config.n_classes)}, position_embedding_type="absolute",
                classifier_dropout=None, is_decoder=False, add_cross_attention=False,
                pad_token_id=enc.pad_token_id)


def params_to_hf(config: BertConfig, ref: Mapping[str, Any], with_classifier: bool = True) -> dict[str, Any]:
    """torch_ref layout -> BertForSequenceClassification keys (``bert.`` prefix) or BertModel keys."""
    prefix = "bert." if with_classifier else ""
    out = {}
    for key, v in ref.items():
        mod, _, leaf = key.rpartition(".")
        if leaf == "scale":
            leaf = "weight"
        m = re.match(r"^layers\.(\d+)\.(.+)$", mod)
        if m:
            mod = f"{prefix}encoder.layer.{m.group(1)}.{_LAYER[m.group(2)]}"
        elif mod in _TOP:
            mod = f"{prefix}{_TOP[mod]}"
        out[f"{mod}.{leaf}"] = v
    return out
