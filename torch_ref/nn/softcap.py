"""Soft-capping mirroring jaxgpt/nn/kernels/softcap.py: x -> cap * tanh(x / cap) (Gemma 2's scores and logits)."""
from __future__ import annotations

import torch


def softcap(x, cap: float | None):
    """cap * tanh(x / cap), written as HF Gemma 2 writes it (divide, tanh, multiply); x when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
