"""A torch mirror of nanoGPT's training recipe (karpathy/nanoGPT ``train.py`` with
``config/train_shakespeare_char.py``), built on torch_ref's DecoderLM.

nanoGPT's own source is not installed here; this module re-implements, line for line in spirit,
the parts of ``train.py`` that decide the loss it prints:

* the model: nanoGPT's GPT with ``bias=False`` is torch_ref's DecoderLM with learned positions,
  LayerNorm (eps 1e-5, no bias), exact GELU 4x MLP without biases, a tied head, N(0, 0.02) init
  and the residual projections (attention c_proj and MLP c_proj) at 0.02 / sqrt(2 n_layer).
  (nanoGPT fuses q, k, v into one ``c_attn``; torch_ref keeps three Linear layers with the same
  N(0, 0.02) distribution, so the two differ only in which random numbers are drawn.)
* ``configure_optimizers``: AdamW with two groups, weight decay on every parameter with
  ``dim() >= 2`` (all Linear weights *and both embeddings*, the token one being the tied head)
  and none on the 1-D ones (LayerNorm weights); betas (0.9, beta2), eps 1e-8.
* ``get_lr``: linear warmup ``lr * (it + 1) / (warmup_iters + 1)``, cosine from lr to min_lr
  between warmup_iters and lr_decay_iters, min_lr after.
* ``get_batch``: ``torch.randint(len(data) - block_size, (batch_size,))`` window starts from
  torch's global generator (seeded ``torch.manual_seed(1337 + seed)`` as nanoGPT seeds it).
* ``estimate_loss``: mean over ``eval_iters`` random batches of each split, model in eval mode.
* the loop: lr set, evaluation every ``eval_interval`` iterations *before* that iteration's
  update, forward, next batch prefetched, backward, ``clip_grad_norm_(grad_clip)``, step.
  nanoGPT breaks when ``iter_num > max_iters`` (so it makes max_iters + 1 updates, the last one
  never evaluated); here the loop stops right after the evaluation at ``max_iters``, which is the
  loss nanoGPT reports, so the returned model is the one that loss belongs to.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from jaxgpt.config import ModelConfig
from torch_ref.models.decoder import DecoderLM


@dataclass
class NanoConfig:
    """nanoGPT's train.py defaults with config/train_shakespeare_char.py and the README's CPU
    overrides (--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
    --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --eval_iters=20)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12
    dropout: float = 0.0
    bias: bool = False
    vocab_size: int = 65
    learning_rate: float = 1e-3
    max_iters: int = 2000
    lr_decay_iters: int = 2000
    min_lr: float = 1e-4
    warmup_iters: int = 100
    decay_lr: bool = True
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    # 'nanogpt': decay on every >=2-D param (embeddings included); 'all' / 'linear': jaxgpt's
    # TrainConfig.decay choices, for ablations only.
    decay: str = "nanogpt"
    extra: dict = field(default_factory=dict)


def model_config(nc: NanoConfig) -> ModelConfig:
    """nanoGPT's GPTConfig as a jaxgpt ModelConfig (the same mapping as jaxgpt.convert.nanogpt)."""
    return ModelConfig(vocab_size=nc.vocab_size, max_len=nc.block_size, d_model=nc.n_embd, n_layer=nc.n_layer,
                       n_head=nc.n_head, pos="learned", norm="layernorm", norm_eps=1e-5, norm_bias=nc.bias,
                       mlp="gelu", mlp_bias=nc.bias, qkv_bias=nc.bias, o_bias=nc.bias, tie_embeddings=True,
                       dropout=nc.dropout, attn_dropout=nc.dropout, scale_out_init=True)


def param_groups(model: torch.nn.Module, weight_decay: float, decay: str = "nanogpt") -> list[dict]:
    """nanoGPT's configure_optimizers groups: decay on dim >= 2, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay == "nanogpt":
        is_decayed = lambda p: p.dim() >= 2
    elif decay == "all":
        is_decayed = lambda p: True
    elif decay == "linear":
        linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        is_decayed = lambda p: id(p) in linear
    else:
        raise ValueError(f"decay must be 'nanogpt', 'all' or 'linear', got {decay!r}")
    return [{"params": [p for p in params if is_decayed(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not is_decayed(p)], "weight_decay": 0.0}]


def get_lr(it: int, nc: NanoConfig) -> float:
    """nanoGPT's get_lr."""
    if not nc.decay_lr:
        return nc.learning_rate
    if it < nc.warmup_iters:
        return nc.learning_rate * (it + 1) / (nc.warmup_iters + 1)
    if it > nc.lr_decay_iters:
        return nc.min_lr
    decay_ratio = (it - nc.warmup_iters) / (nc.lr_decay_iters - nc.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return nc.min_lr + coeff * (nc.learning_rate - nc.min_lr)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int):
    """nanoGPT's get_batch (CPU branch): random windows from torch's global generator."""
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)


@torch.no_grad()
def estimate_loss(model, splits: dict, nc: NanoConfig) -> dict:
    """nanoGPT's estimate_loss: mean loss of eval_iters random batches per split."""
    out = {}
    model.eval()
    for name, data in splits.items():
        losses = torch.zeros(nc.eval_iters)
        for k in range(nc.eval_iters):
            x, y = get_batch(data, nc.batch_size, nc.block_size)
            losses[k] = loss_of(model, x, y).item()
        out[name] = losses.mean().item()
    model.train()
    return out


@torch.no_grad()
def window_loss(model, windows: np.ndarray, chunk: int = 128) -> float:
    """Token-mean loss over fixed windows (N, T + 1) (x = w[:, :-1], y = w[:, 1:]), eval mode."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), chunk):
        w = torch.as_tensor(windows[i:i + chunk]).long()
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train(nc: NanoConfig, train_ids: np.ndarray, val_ids: np.ndarray, seed: int = 0, *, log_every: int = 10,
          verbose: bool = False) -> dict:
    """nanoGPT's training loop (see the module docstring). Returns {model, history (train loss of
    every log_every-th iteration), evals ([{iter, train, val, lr}] from estimate_loss), seconds,
    ms_per_step}."""
    torch.manual_seed(1337 + seed)
    model = DecoderLM(model_config(nc))
    model.train()
    opt = torch.optim.AdamW(param_groups(model, nc.weight_decay, nc.decay), lr=nc.learning_rate,
                            betas=(nc.beta1, nc.beta2))
    train_data = torch.from_numpy(np.asarray(train_ids, np.int64))
    val_data = torch.from_numpy(np.asarray(val_ids, np.int64))
    splits = {"train": train_data, "val": val_data}
    history, evals = [], []
    x, y = get_batch(train_data, nc.batch_size, nc.block_size)
    t_train, t_eval = 0.0, 0.0
    it = 0
    while True:
        lr = get_lr(it, nc)
        for g in opt.param_groups:
            g["lr"] = lr
        if it % nc.eval_interval == 0 or it == nc.max_iters:
            t = time.perf_counter()
            losses = estimate_loss(model, splits, nc)
            t_eval += time.perf_counter() - t
            evals.append({"iter": it, "train": losses["train"], "val": losses["val"], "lr": lr})
            if verbose:
                print(f"  torch seed {seed} iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
        if it >= nc.max_iters:
            break
        t = time.perf_counter()
        loss = loss_of(model, x, y)
        x, y = get_batch(train_data, nc.batch_size, nc.block_size)
        loss.backward()
        if nc.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), nc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        t_train += time.perf_counter() - t
        if it % log_every == 0 or it == 1:
            history.append({"step": it, "loss": loss.item(), "lr": lr})
    return {"model": model, "history": history, "evals": evals, "seconds": t_train + t_eval,
            "train_s": t_train, "ms_per_step": 1e3 * t_train / max(nc.max_iters, 1)}
