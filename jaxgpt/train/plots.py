"""The figures ``fit`` writes beside a run: the loss curve, and for MoE models the per-expert load."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path, axes=(), dpi: int = 120) -> Path:
    """A light grid on ``axes``, a tight layout, the PNG at ``path``; closes ``fig``. Legends are the
    caller's (each figure places its own)."""
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_losses(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Per-step training loss, its 20-step moving average and the validation loss -> PNG."""
    plt = _pyplot()
    if plt is None:
        return None
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    if train:
        s, l = map(np.asarray, zip(*train))
        ax.plot(s, l, alpha=0.3, color="tab:blue", label="train loss (per step)")
        if len(l) >= 20:
            ax.plot(s[19:], np.convolve(l, np.ones(20) / 20, mode="valid"), color="tab:blue", label="train (20-step mean)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", label="validation loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    ax.legend()
    return save_figure(fig, path, [ax])


def plot_expert_load(history: list[dict], path: Path, title: str = "") -> Path | None:
    """MoE runs: each expert's share of the top-k picks per logged step (averaged over layers; the
    fair share 1 / E dashed), and the busiest expert in any layer over its fair share -> PNG."""
    plt = _pyplot()
    rows = [r for r in history if "expert_load" in r]
    if plt is None or not rows:
        return None
    steps = [r["step"] for r in rows]
    load = np.asarray([r["expert_load"] for r in rows])  # (steps, E)
    fig, (ax, top) = plt.subplots(1, 2, figsize=(11, 4))
    for e in range(load.shape[1]):
        ax.plot(steps, load[:, e], lw=1, label=f"expert {e}" if load.shape[1] <= 16 else None)
    ax.axhline(1 / load.shape[1], color="k", ls="--", lw=1, label="fair share")
    ax.set(xlabel="step", ylabel="share of the top-k picks", title=f"per-expert load {title}".strip())
    top.plot(steps, [r["expert_load_max"] for r in rows], color="tab:red")
    top.axhline(1.0, color="k", ls="--", lw=1)
    top.set(xlabel="step", ylabel="busiest expert / fair share", title="max load (1 = balanced)")
    if load.shape[1] <= 16:
        ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path, [ax, top])


__all__ = ["plot_expert_load", "plot_losses", "save_figure"]
