"""Feed-forward networks mirroring jaxgpt/mlp.py (fc_in/fc_out; gate_proj/up_proj/down_proj)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def linear(d_in: int, d_out: int, use_bias: bool, std: float) -> nn.Linear:
    """nn.Linear with N(0, std) weight and zero bias (the GPT-2 / seed initialisation)."""
    layer = nn.Linear(d_in, d_out, bias=use_bias)
    nn.init.normal_(layer.weight, std=std)
    if use_bias:
        nn.init.zeros_(layer.bias)
    return layer


class MLP(nn.Module):
    """fc_out(act(fc_in(x))). x: (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", use_bias: bool = True,
                 init_std: float = 0.02, out_init_std: float = 0.02):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.fc_in = linear(d_model, d_ff, use_bias, init_std)
        self.fc_out = linear(d_ff, d_model, use_bias, out_init_std)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)). x: (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, d_ff: int, use_bias: bool = False, init_std: float = 0.02,
                 out_init_std: float = 0.02):
        super().__init__()
        self.gate_proj = linear(d_model, d_ff, use_bias, init_std)
        self.up_proj = linear(d_model, d_ff, use_bias, init_std)
        self.down_proj = linear(d_ff, d_model, use_bias, out_init_std)

    gate_act = staticmethod(F.silu)  # the gate's activation (GeGLU: tanh-GELU)

    def forward(self, x):
        return self.down_proj(self.gate_act(self.gate_proj(x)) * self.up_proj(x))


def gelu_tanh(x):
    """torch's gelu(approximate='tanh'), HF's gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")


class GeGLU(SwiGLU):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) (``mlp='geglu_tanh'``, Gemma's MLP). x: (..., d_model) -> (..., d_model)."""

    gate_act = staticmethod(gelu_tanh)


def make_mlp(config) -> nn.Module:
    """The feed-forward network a ModelConfig names."""
    common = dict(d_model=config.d_model, d_ff=config.ffn_dim, use_bias=config.mlp_bias,
                  init_std=config.init_std, out_init_std=config.out_init_std)
    if config.mlp == "swiglu":
        return SwiGLU(**common)
    if config.mlp == "geglu_tanh":
        return GeGLU(**common)
    return MLP(activation=config.mlp, **common)
