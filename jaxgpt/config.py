"""Frozen, validated model configuration shared by jaxgpt (Flax) and torch_ref (PyTorch).

This module imports no framework on purpose: torch_ref builds its modules from the very same
objects, so a config means the same architecture on both sides.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

POS = ("none", "sinusoidal", "learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu")
PLACEMENTS = ("pre", "post")
ROPE_LAYOUTS = ("half", "interleaved")

# torch.nn.RMSNorm(eps=None) uses the float32 machine epsilon; seed 002 relies on that default.
FLOAT32_EPS = 1.1920928955078125e-07


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """One transformer stack. Variants are knobs, not subclasses.

    Sizes: ``d_model`` is split into ``n_head`` heads of ``head_dim``; keys and values use
    ``n_kv_head`` heads (``None`` = ``n_head``: MHA; 1: MQA; otherwise GQA).
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_ff: int | None = None  # None: 4 * d_model (swiglu: 2/3 of that, rounded up to a multiple of 8)
    max_len: int = 256  # context window; sizes learned/sinusoidal tables and KV caches
    pos: str = "sinusoidal"
    rope_base: float = 10000.0
    rope_layout: str = "half"  # 'half' = HF LLaMA rotate_half, 'interleaved' = adjacent pairs (seed 000)
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    mlp: str = "swiglu"
    mlp_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    norm_placement: str = "pre"
    final_norm: bool = True
    dropout: float = 0.0  # embedding and residual-branch dropout
    attn_dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    scale_out_init: bool = False  # GPT-2: o_proj/down_proj/fc_out std = init_std / sqrt(2 n_layer)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_len"):
            _positive(name, getattr(self, name))
        if self.n_kv_head is not None:
            _positive("n_kv_head", self.n_kv_head)
        if self.d_ff is not None:
            _positive("d_ff", self.d_ff)
        _choice("pos", self.pos, POS)
        _choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        _choice("norm", self.norm, NORMS)
        _choice("mlp", self.mlp, MLPS)
        _choice("norm_placement", self.norm_placement, PLACEMENTS)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.pos == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        _probability("dropout", self.dropout)
        _probability("attn_dropout", self.attn_dropout)

    # Derived sizes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":  # keep the parameter count of a 4x two-matrix MLP
            return -(-(8 * self.d_model // 3) // 8) * 8
        return 4 * self.d_model

    @property
    def out_init_std(self) -> float:
        """Init std of the projections that write into the residual stream."""
        return self.init_std / (2 * self.n_layer) ** 0.5 if self.scale_out_init else self.init_std

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**d)
