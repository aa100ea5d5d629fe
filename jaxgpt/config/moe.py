"""MoEConfig: the Mixture-of-Experts feed-forward option of a ModelConfig (``ModelConfig.moe``).

A router (a Linear without bias) scores ``n_experts`` SwiGLU experts per token; a float32 softmax
over all experts, then top-k, then (``norm_topk``) renormalising the k weights, gives the mix. This
is Mixtral's router (``norm_topk=True``) and Qwen2-MoE's (``norm_topk`` = its ``norm_topk_prob``,
off by default there). Dropless by default: every token reaches its k experts; ``capacity_factor``
(impl 'alltoall' only) bounds each expert's tokens per group and drops the overflow.
Framework-free: torch_ref builds its MoE layer from the same object.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxgpt.config.base import _Config, _choice, _positive

# 'dense': every expert on every token, weighted by the (mostly zero) routing weights: one einsum, exact,
# fast on the CPU for a few experts. 'grouped': tokens sorted by expert and multiplied group by group with
# jax.lax.ragged_dot (k/E of the dense FLOPs on accelerators; on the CPU ragged_dot lowers to a masked
# dense product). 'alltoall': per-expert capacity buffers, sent to the devices holding their experts with an
# all-to-all under a mesh with an 'expert' axis (jaxgpt/nn/moe_dispatch.py); the only impl that takes a
# capacity_factor. Dropless, the three are the same math: an engine knob. 'auto' (the default): 'grouped' in
# a program lowered for CUDA or TPU, 'dense' on the CPU (and elsewhere), chosen per lowering platform.
MOE_IMPLS = ("auto", "dense", "grouped", "alltoall")
# How the load-balancing loss spans the layers. 'pooled': transformers' load_balancing_loss_func, every layer's
# router rows pooled into one f_e and P_e (what HF Mixtral / Qwen2-MoE train with; layers that favour different
# experts cancel out in it). 'layer': the loss of each layer, averaged (Switch Transformer, MaxText): each layer's
# own imbalance is penalised.
AUX_LOSS_SCOPES = ("pooled", "layer")


@dataclass(frozen=True)
class MoEConfig(_Config):
    """Which layers are sparse and what their router and experts are.

    Layer i (0-based) is sparse when ``(i + 1) % every == 0`` and i is not in ``dense_layers``
    (Qwen2-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``); the other layers keep the
    ModelConfig's dense MLP (``d_ff``).
    """

    n_experts: int = 8
    top_k: int = 2
    d_ff: int | None = None  # width of each expert; None: the ModelConfig's ffn_dim
    norm_topk: bool = True  # renormalise the k routing weights to sum to 1 (Mixtral); False: raw softmax (Qwen2-MoE)
    shared_d_ff: int = 0  # > 0: a shared SwiGLU expert on every token, scaled by sigmoid(shared_expert_gate(x))
    every: int = 1
    dense_layers: tuple | list = ()  # layer indices that stay dense
    impl: str = "auto"  # one of MOE_IMPLS (engine knob: same math)
    # None: dropless. A float > 0 (impl='alltoall'): each expert takes at most
    # ceil(capacity_factor * tokens_in_group * top_k / n_experts) tokens of a group, first choices first, then
    # token order; the rest of its tokens skip it (jaxgpt/nn/moe_dispatch.py). 1.0: room for a balanced load.
    capacity_factor: float | None = None
    # The load-balancing loss coefficient this model trains with (HF's router_aux_loss_coef: 0.001 in
    # Mixtral's and Qwen2-MoE's configs; Switch's 0.01 here). TrainConfig.router_aux_coef overrides it per run.
    aux_loss_coef: float = 0.01
    aux_loss_scope: str = "pooled"  # one of AUX_LOSS_SCOPES

    def _validate(self) -> None:
        _positive("moe.n_experts", self.n_experts)
        _positive("moe.top_k", self.top_k)
        _positive("moe.every", self.every)
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}")
        if self.d_ff is not None:
            _positive("moe.d_ff", self.d_ff)
        if self.shared_d_ff < 0:
            raise ValueError(f"moe.shared_d_ff must be >= 0 (0: no shared expert), got {self.shared_d_ff}")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        bad = [i for i in self.dense_layers if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if bad:
            raise ValueError(f"moe.dense_layers must hold layer indices >= 0, got {list(self.dense_layers)}")
        _choice("moe.impl", self.impl, MOE_IMPLS)
        cf = self.capacity_factor
        if cf is not None:
            if not cf > 0:  # the type (a finite float) is checked by _Config
                raise ValueError(f"moe.capacity_factor must be None (dropless) or a finite number > 0, got {cf!r}")
            if self.impl != "alltoall":
                raise ValueError(f"moe.capacity_factor={cf!r} needs moe.impl='alltoall' (the 'dense' and 'grouped' "
                                 f"impls are dropless); got impl={self.impl!r}")
        _choice("moe.aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"moe.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a MoE layer."""
        return (layer + 1) % self.every == 0 and layer not in self.dense_layers
