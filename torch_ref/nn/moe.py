"""Mixture-of-Experts feed-forward network mirroring jaxgpt/nn/moe.py (router, experts,
shared_expert, shared_expert_gate). Expert weights are the same (E, in, out) arrays as jaxgpt's,
not transposed; the computation is transformers' loop over the experts that were picked.

``MoEConfig.capacity_factor`` (jaxgpt's impl 'alltoall', jaxgpt/nn/moe_dispatch.py) with the whole
batch as one group: each expert keeps its first C = ceil(factor * N * k / E) (at most N) picks, every
token's first choice before any token's second choice, then in token order; a dropped pick adds nothing."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torch_ref.nn.mlp import SwiGLU, linear


class Experts(nn.Module):
    """gate_proj, up_proj (E, d, f) and down_proj (E, f, d)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, init_std: float = 0.02, out_init_std: float = 0.02):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * init_std)
        self.up_proj = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * init_std)
        self.down_proj = nn.Parameter(torch.randn(n_experts, d_ff, d_model) * out_init_std)

    def forward(self, x, weights, idx, keep=None):
        """x (N, d), weights/idx (N, k), keep (N, k) bool or None (all) -> (N, d): each picked expert
        on its kept tokens, weighted, summed."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            token, slot = torch.where((idx == e) if keep is None else (idx == e) & keep)
            h = x[token]
            h = F.silu(h @ self.gate_proj[e]) * (h @ self.up_proj[e])
            out.index_add_(0, token, (h @ self.down_proj[e]) * weights[token, slot, None].to(x.dtype))
        return out


class MoE(nn.Module):
    """Sparse feed-forward network of a ModelConfig with ``moe`` set. x: (..., d) -> (..., d).
    After each forward, ``self.stats`` holds the router statistics jaxgpt sows (router_losses)."""

    def __init__(self, config):
        super().__init__()
        cfg, moe = config, config.moe
        self.top_k, self.norm_topk, self.n_experts = moe.top_k, moe.norm_topk, moe.n_experts
        self.capacity_factor = moe.capacity_factor
        self.router = linear(cfg.d_model, moe.n_experts, False, cfg.init_std)
        self.experts = Experts(moe.n_experts, cfg.d_model, cfg.expert_dim, cfg.init_std, cfg.out_init_std)
        if moe.shared_d_ff:
            self.shared_expert = SwiGLU(cfg.d_model, moe.shared_d_ff, False, cfg.init_std, cfg.out_init_std)
            self.shared_expert_gate = linear(cfg.d_model, 1, False, cfg.init_std)
        self.stats = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = None if self.capacity_factor is None else self.kept(idx)
        y = self.experts(x, weights, idx, keep)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        self.stats = {"counts": F.one_hot(idx, self.n_experts).float().sum((0, 1)), "probs": probs.sum(0),
                      "z": (torch.logsumexp(logits.float(), -1) ** 2).sum(), "rows": float(x.shape[0]),
                      "dropped": 0.0 if keep is None else float((~keep).sum())}
        return y.reshape(shape)

    def kept(self, idx):
        """(N, k) expert ids -> (N, k) bool: within its expert's capacity, by the priority rule above."""
        n, k = idx.shape
        cap = min(n, math.ceil(self.capacity_factor * n * k / self.n_experts))
        keep = torch.zeros_like(idx, dtype=torch.bool)
        taken = [0] * self.n_experts
        for j in range(k):  # choice rank first
            for t in range(n):  # then token order
                e = int(idx[t, j])
                keep[t, j] = taken[e] < cap
                taken[e] += 1
        return keep


def router_losses(model: nn.Module, scope: str = "pooled"):
    """(load-balancing loss, z-loss) of the model's last forward, as jaxgpt.nn.moe.router_losses
    (``scope``: 'pooled' over every layer's rows, or 'layer': per layer, averaged)."""
    stats = [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]
    if not stats:
        return torch.zeros(()), torch.zeros(())
    e = stats[0]["counts"].shape[0]
    rows = sum(s["rows"] for s in stats)
    z = sum(s["z"] for s in stats) / rows
    if scope == "layer":
        return e * torch.stack([torch.sum(s["counts"] * s["probs"]) / s["rows"] ** 2 for s in stats]).mean(), z
    if scope != "pooled":
        raise ValueError(f"aux_loss_scope={scope!r} is not 'pooled' or 'layer'")
    counts, probs = sum(s["counts"] for s in stats), sum(s["probs"] for s in stats)
    return e * torch.sum(counts / rows * probs / rows), z


def expert_counts(model: nn.Module) -> torch.Tensor:
    """(L, E): each MoE layer's top-k picks per expert in the model's last forward, as
    jaxgpt.nn.moe.expert_counts."""
    return torch.stack([m.stats["counts"] for m in model.modules() if isinstance(m, MoE) and m.stats is not None])


def expert_dropped(model: nn.Module) -> torch.Tensor:
    """(L,): each MoE layer's (token, expert) pairs dropped by the capacity factor in the model's last
    forward, as jaxgpt.nn.moe.expert_dropped."""
    return torch.tensor([m.stats["dropped"] for m in model.modules() if isinstance(m, MoE) and m.stats is not None])


def load_metrics(counts: torch.Tensor, dropped: torch.Tensor | None = None) -> dict:
    """As jaxgpt.nn.moe.load_metrics: expert_load (E,) (a list), expert_load_max (a float), and with
    ``dropped`` expert_dropped (a float)."""
    share = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
    out = {"expert_load": share.mean(0).tolist(), "expert_load_max": float(share.max() * counts.shape[-1])}
    if dropped is not None:
        out["expert_dropped"] = float(dropped.sum() / counts.sum().clamp(min=1.0))
    return out

