"""GeGLU with the tanh-approximated GELU (``ModelConfig.mlp='geglu_tanh'``, Gemma's MLP):
down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)), SwiGLU's parameters with another gate activation."""
from __future__ import annotations

from typing import Callable, ClassVar

import jax

from jaxgpt.nn.mlp import SwiGLU


def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): torch's gelu(approximate='tanh'), HF's gelu_pytorch_tanh."""
    return jax.nn.gelu(x, approximate=True)


class GeGLU(SwiGLU):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)). x: (..., d_model) -> (..., d_model)."""

    gate_act: ClassVar[Callable] = staticmethod(gelu_tanh)
