"""GeGLU with the tanh-approximated GELU, mirroring jaxgpt/nn/geglu.py (gate_proj/up_proj/down_proj)."""
from __future__ import annotations

import torch.nn.functional as F

from torch_ref.nn.mlp import SwiGLU


def gelu_tanh(x):
    """torch's gelu(approximate='tanh'), HF's gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")


class GeGLU(SwiGLU):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)). x: (..., d_model) -> (..., d_model)."""

    gate_act = staticmethod(gelu_tanh)
