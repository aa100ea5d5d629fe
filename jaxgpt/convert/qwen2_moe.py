"""Hugging Face Qwen2MoeForCausalLM: Qwen2 (llama.py: q/k/v biases, no o bias) with MoE layers.

Differences from Mixtral (mixtral.py, whose expert gathering this reuses): the k routing weights
are renormalised only with ``norm_topk_prob`` (default False); every MoE layer adds a shared
SwiGLU expert scaled by sigmoid(shared_expert_gate(x)); ``decoder_sparse_step`` and
``mlp_only_layers`` choose the MoE layers, the others keep a dense SwiGLU of ``intermediate_size``
(experts: ``moe_intermediate_size``). Mixed dense and MoE layers load as separate layers (``Execution.for_model``: scan_layers=False).

HF key                                                    torch_ref key
model.layers.{i}.mlp.gate.weight (E, d)               <-> layers.{i}.mlp.router.weight
model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj  <-> layers.{i}.mlp.experts.{...}[e] (w.T stacked)
  (or fused: mlp.experts.gate_up_proj / down_proj, as mixtral.py)
model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate <-> the same under layers.{i}.mlp
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig, MoEConfig
from jaxgpt.convert import llama, mixtral
from jaxgpt.convert.common import (MAPPED, Field, Option, check_fields, check_options, inert, load_ref, must_be, refuse,
                                   rename)

ARCHS = ("Qwen2MoeForCausalLM",)
_NAMES = {n: n for n in ("gate_proj", "up_proj", "down_proj")}
OPTIONS = {
    **llama.OPTIONS["qwen2"],
    "qkv_bias": MAPPED, "num_experts": MAPPED, "num_experts_per_tok": MAPPED, "norm_topk_prob": MAPPED,
    "moe_intermediate_size": MAPPED, "shared_expert_intermediate_size": MAPPED, "decoder_sparse_step": MAPPED,
    "mlp_only_layers": MAPPED,
    "output_router_logits": inert("whether forward returns router logits (the aux loss is jaxgpt's TrainConfig)"),
    "router_aux_loss_coef": MAPPED,  # -> moe.aux_loss_coef
    # Qwen2-MoE picks its sliding layers by a rule of its own (odd layers below max_window_layers): not implemented
    "use_sliding_window": Option(lambda v, d: not v or llama._window({**d, "model_type": "mistral"}) is None,
                                 "False, or a sliding_window covering the context (Qwen2-MoE's windows are not "
                                 "implemented)"),
    "layer_types": Option(lambda v, d: all(t == "full_attention" for t in v) or not d.get("use_sliding_window")
                          or llama._window({**d, "model_type": "mistral"}) is None, "full_attention layers"),
    "max_window_layers": inert("which layers would slide; sliding windows are refused through use_sliding_window"),
    "sliding_window": inert("its size; sliding windows are refused through use_sliding_window (0 when off)"),
}
_QWEN2 = set(llama.OPTIONS["qwen2"])
RULES = [(r"model\.layers\.(\d+)\.mlp\.(.+)", r"layers.\1.mlp.\2")] + llama.RULES


def config_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """An HF Qwen2-MoE config dict -> ModelConfig; every unsupported option named at once."""
    check_options(d, OPTIONS, "Qwen2-MoE")
    windows = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")  # refused above
    base = llama.config_from_hf({**{k: v for k, v in d.items() if k in _QWEN2 and k not in windows},
                                 "model_type": "qwen2"}, "Qwen2ForCausalLM")
    shared = d.get("shared_expert_intermediate_size", 5632)
    if not shared:
        raise ValueError("HF Qwen2-MoE config not supported exactly by jaxgpt: shared_expert_intermediate_size="
                         f"{shared!r} (supported: > 0; Qwen2-MoE always has a shared expert)")
    moe = MoEConfig(n_experts=d.get("num_experts", 60), top_k=d.get("num_experts_per_tok", 4),
                    d_ff=d.get("moe_intermediate_size", 1408), norm_topk=bool(d.get("norm_topk_prob", False)),
                    shared_d_ff=shared, every=d.get("decoder_sparse_step", 1),
                    dense_layers=tuple(d.get("mlp_only_layers") or ()),
                    aux_loss_coef=d.get("router_aux_loss_coef", 0.001))  # Qwen2MoeConfig's default
    qkv = bool(d.get("qkv_bias", True))
    return base.replace(moe=moe, qkv_bias=qkv)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, Any], arch: str, template=None) -> dict:
    skip = lambda key: key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_embeddings)
    tensors = mixtral.gather_experts({k: v for k, v in tensors.items() if not skip(k)}, _NAMES)
    return load_ref(config, rename(tensors, RULES), template)


FIELDS: dict[str, Field] = {
    **llama.FIELDS,
    "qkv_bias": Field(lambda v, c: True, "-> qkv_bias"), "o_bias": Field(lambda v, c: not v, "False"),
    "mlp_bias": Field(lambda v, c: not v, "False"),
    "sliding_window": must_be(None), "window_layers": must_be(None),
    "moe": Field(lambda v, c: v is not None and v.shared_d_ff > 0 and v.capacity_factor is None,
                 "a MoEConfig with shared_d_ff > 0 and capacity_factor=None (HF Qwen2-MoE drops no token: export "
                 "with moe.capacity_factor=None)"),
}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    refuse(check_fields(config, FIELDS, "Qwen2-MoE"), "Qwen2-MoE")
    moe = config.moe
    d = llama.config_to_hf(config.replace(moe=None, qkv_bias=True, o_bias=False, mlp_bias=False))
    d.update(model_type="qwen2_moe", architectures=list(ARCHS), qkv_bias=config.qkv_bias,
             num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk,
             moe_intermediate_size=config.expert_dim, shared_expert_intermediate_size=moe.shared_d_ff,
             decoder_sparse_step=moe.every, mlp_only_layers=list(moe.dense_layers), output_router_logits=False,
             max_window_layers=config.n_layer, router_aux_loss_coef=moe.aux_loss_coef)
    return d


def params_to_hf(config: ModelConfig, ref: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    moe_key = re.compile(r"layers\.(\d+)\.(mlp\.(?:router\.weight|experts\..+))")
    out = llama.params_to_hf(config, {k: v for k, v in ref.items() if not moe_key.fullmatch(k)})
    for key, a in ref.items():
        if m := moe_key.fullmatch(key):
            for hf_key, arr in mixtral.split_experts(m.group(2), a, f"model.layers.{m.group(1)}.mlp", _NAMES):
                out[hf_key] = arr
    return out
