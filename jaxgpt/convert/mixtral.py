"""Hugging Face MixtralForCausalLM: the LLaMA layout (llama.py) with every FFN a Mixture of Experts.

The router is a Linear without bias, softmax over all experts, top-k, the k weights renormalised
(``MoEConfig(norm_topk=True)``); experts are SwiGLU. Two expert key layouts are read:

HF key (saved by transformers, the original checkpoints)     torch_ref key
model.layers.{i}.block_sparse_moe.gate.weight (E, d)     <-> layers.{i}.mlp.router.weight
model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2   <-> layers.{i}.mlp.experts.gate_proj/up_proj/down_proj[e]
                                                             (E, d, f) / (E, d, f) / (E, f, d): w.T stacked
HF key (transformers >= 5 in memory: fused)
model.layers.{i}.mlp.gate.weight (E, d)                  <-> layers.{i}.mlp.router.weight
model.layers.{i}.mlp.experts.gate_up_proj (E, 2f, d)     <-> gate_proj = [:, :f].T, up_proj = [:, f:].T per expert
model.layers.{i}.mlp.experts.down_proj (E, d, f)         <-> down_proj (E, f, d), transposed per expert

Everything else is llama.py's. Export writes the first layout, the one transformers saves.
Refused by name: router_jitter_noise (training-time noise jaxgpt does not draw). A sliding_window
slides every layer, as Mistral's (llama.py).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig, MoEConfig
from jaxgpt.convert import llama
from jaxgpt.convert.common import (MAPPED, Field, check_fields, check_options, equals, inert, load_ref, maps_to, must_be,
                                   refuse, rename)
from jaxgpt.convert.rule import to_numpy

ARCHS = ("MixtralForCausalLM",)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")
LEGACY = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's per-expert names

OPTIONS = {
    **{k: v for k, v in llama.OPTIONS["mistral"].items()},
    "num_local_experts": MAPPED, "num_experts_per_tok": MAPPED,
    "router_jitter_noise": equals(0.0, 0),
    "output_router_logits": inert("whether forward returns router logits (the aux loss is jaxgpt's TrainConfig)"),
    "router_aux_loss_coef": MAPPED,  # -> moe.aux_loss_coef
}


def gather_experts(tensors: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict:
    """HF expert and router keys (per-expert or fused) -> torch_ref keys layers.{i}.mlp.router.weight
    and layers.{i}.mlp.experts.{gate,up,down}_proj (E, in, out); every other key passed through.
    ``names``: per-expert projection names -> torch_ref names (Mixtral's w1/w3/w2; Qwen2-MoE's own)."""
    names = names or {n: n for n in ("gate_proj", "up_proj", "down_proj")}
    out, per = {}, {}
    for key, value in tensors.items():
        if m := _EXPERT.fullmatch(key):
            layer, e, proj = m.groups()
            if proj not in names:
                out[key] = value  # unexpected: reported by the strict rule
                continue
            per.setdefault((layer, names[proj]), {})[int(e)] = to_numpy(value).T  # (in, out)
        elif m := _FUSED.fullmatch(key):
            layer, proj = m.groups()
            a = to_numpy(value)
            if proj == "gate_up_proj":  # (E, 2f, d): gate rows then up rows
                f = a.shape[1] // 2
                out[f"layers.{layer}.mlp.experts.gate_proj"] = np.ascontiguousarray(a[:, :f].transpose(0, 2, 1))
                out[f"layers.{layer}.mlp.experts.up_proj"] = np.ascontiguousarray(a[:, f:].transpose(0, 2, 1))
            else:  # (E, d, f)
                out[f"layers.{layer}.mlp.experts.down_proj"] = np.ascontiguousarray(a.transpose(0, 2, 1))
        elif m := _ROUTER.fullmatch(key):
            out[f"layers.{m.group(1)}.mlp.router.weight"] = value
        else:
            out[key] = value
    for (layer, proj), experts in per.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"layer {layer} {proj}: expert indices {sorted(experts)} are not 0..{len(experts) - 1}")
        out[f"layers.{layer}.mlp.experts.{proj}"] = np.stack([experts[e] for e in range(len(experts))])
    return out


def split_experts(rest: str, a: np.ndarray, prefix: str, names: Mapping[str, str]):
    """One torch_ref MoE key of a layer (after 'layers.{i}.') -> [(HF key suffix, array)] in the
    per-expert layout, or None when ``rest`` is not an expert/router key."""
    if rest == "mlp.router.weight":
        return [(f"{prefix}.gate.weight", a)]
    m = re.fullmatch(r"mlp\.experts\.(gate_proj|up_proj|down_proj)", rest)
    if m is None:
        return None
    hf = {v: k for k, v in names.items()}[m.group(1)]
    return [(f"{prefix}.experts.{e}.{hf}.weight", np.ascontiguousarray(a[e].T)) for e in range(a.shape[0])]


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF Mixtral config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "Mixtral")
    base = llama.config_from_hf({**{k: v for k, v in d.items() if k in llama.OPTIONS["mistral"]},
                                 "model_type": "mistral"}, "MistralForCausalLM")
    moe = MoEConfig(n_experts=d.get("num_local_experts", 8), top_k=d.get("num_experts_per_tok", 2), norm_topk=True,
                    aux_loss_coef=d.get("router_aux_loss_coef", 0.001))  # MixtralConfig's default
    return base.replace(moe=moe)


def _skip(config):
    return lambda key: key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    tensors = gather_experts({k: v for k, v in tensors.items() if not _skip(config)(k)}, LEGACY)
    return load_ref(config, rename(tensors, llama.RULES), template)


def _moe_field(v, c) -> bool:
    return (v is not None and v.norm_topk and v.shared_d_ff == 0 and v.every == 1 and not v.dense_layers
            and v.capacity_factor is None)  # HF runs dropless


FIELDS: dict[str, Field] = {
    **llama.FIELDS,
    "d_ff": Field(lambda v, c: True, "unused: every Mixtral layer is a MoE (moe.d_ff -> intermediate_size)"),
    "mlp_bias": Field(lambda v, c: True, "unused: experts have no biases"),
    "qkv_bias": Field(lambda v, c: not v, "False"), "o_bias": Field(lambda v, c: not v, "False"),
    "sliding_window": maps_to("sliding_window (every layer)"),
    "window_layers": must_be(None),  # MixtralForCausalLM slides every layer or none
    "moe": Field(_moe_field, "MoEConfig with norm_topk=True, shared_d_ff=0, every=1, dense_layers=(), "
                             "capacity_factor=None (HF Mixtral drops no token: export with moe.capacity_factor=None)"),
}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    refuse(check_fields(config, FIELDS, "Mixtral"), "Mixtral")
    d = llama.config_to_hf(config.replace(moe=None, qkv_bias=False, o_bias=False, mlp_bias=False,
                                          d_ff=config.expert_dim))
    for k in ("attention_bias", "mlp_bias", "pretraining_tp"):
        d.pop(k, None)
    d.update(model_type="mixtral", architectures=list(ARCHS), num_local_experts=config.moe.n_experts,
             num_experts_per_tok=config.moe.top_k, router_jitter_noise=0.0, sliding_window=config.sliding_window,
             output_router_logits=False, router_aux_loss_coef=config.moe.aux_loss_coef)
    return d


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = llama.params_to_hf(config, {k: v for k, v in ref.items() if ".mlp." not in k})
    for key, a in ref.items():
        m = re.fullmatch(r"layers\.(\d+)\.(mlp\..+)", key)
        if m:
            for suffix, arr in split_experts(m.group(2), a, f"model.layers.{m.group(1)}.block_sparse_moe", LEGACY):
                out[suffix] = arr
    return out
