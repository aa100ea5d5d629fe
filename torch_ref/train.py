"""The torch training loop mirroring jaxgpt.train: same losses, AdamW settings, schedule,
clipping, gradient accumulation and batches (jaxgpt.data.tasks is NumPy, shared as is).
From the same initial weights on the same batches both give the same loss curve."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from jaxgpt.config import TrainConfig
from jaxgpt.core.constants import DOCUMENT_KEYS, IGNORE_INDEX, batch_keys


def loss_terms(model: nn.Module, batch: dict) -> dict:
    """Forward + summed cross entropy on one batch -> {'loss_sum', 'count', 'correct'} (tensors);
    MoE models add 'router_aux_sum' and 'router_z_sum' (the router losses times count), 'expert_counts'
    and 'expert_dropped', as jaxgpt."""
    *inputs, targets = (torch.as_tensor(batch[k]) for k in batch_keys(model.config))
    inputs = [x.long() if x.dtype != torch.bool else x for x in inputs]
    docs = {k: torch.as_tensor(batch[k]).long() for k in DOCUMENT_KEYS if k in batch}  # packed documents
    logits = model(*inputs, **docs).float()
    targets = targets.long()
    keep = targets != IGNORE_INDEX
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    correct = (keep & (logits.argmax(-1) == targets)).sum()
    terms = {"loss_sum": loss_sum, "count": keep.sum(), "correct": correct}
    if getattr(model.config, "moe", None) is not None:
        from torch_ref.nn.moe import expert_counts, expert_dropped, router_losses

        aux, z = router_losses(model, model.config.moe.aux_loss_scope)
        terms.update(router_aux_sum=aux * terms["count"], router_z_sum=z * terms["count"],
                     expert_counts=expert_counts(model), expert_dropped=expert_dropped(model))
    return terms


def make_optimizer(model: nn.Module, tc: TrainConfig):
    """AdamW over every parameter ('all'), or with decay on nn.Linear weights and MoE expert weights
    only ('linear') or on those and nn.Embedding weights ('matrices'),
    and a LambdaLR following ``tc.lr_at``. Returns (optimizer, scheduler)."""
    from torch_ref.nn.moe import Experts

    params = list(model.parameters())
    if tc.decay == "all":
        groups = [{"params": params, "weight_decay": tc.weight_decay}]
    else:
        kinds = (nn.Linear,) if tc.decay == "linear" else (nn.Linear, nn.Embedding)  # 'matrices': + embeddings
        linear = {id(m.weight) for m in model.modules() if isinstance(m, kinds)}
        linear |= {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
        groups = [{"params": [p for p in params if id(p) in linear], "weight_decay": tc.weight_decay},
                  {"params": [p for p in params if id(p) not in linear], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: tc.lr_at(step) / tc.lr)
    return opt, sched


def train_step(model: nn.Module, opt, sched, tc: TrainConfig, batch: dict) -> dict:
    """One update from a batch with a leading micro-batch axis (grad_accum, micro_batch, ...):
    gradients of the summed loss over all micro-batches, divided by the target count."""
    model.train()
    opt.zero_grad(set_to_none=True)
    totals = dict.fromkeys(("loss_sum", "count", "correct"), 0.0)
    picks = dropped = None
    for i in range(tc.grad_accum):
        terms = loss_terms(model, {k: v[i] for k, v in batch.items()})
        loss = terms["loss_sum"]
        if "router_aux_sum" in terms:
            loss = loss + tc.aux_coef(model.config) * terms["router_aux_sum"] + tc.router_z_coef * terms["router_z_sum"]
            totals = {"router_aux_sum": 0.0, "router_z_sum": 0.0} | totals
        loss.backward()
        totals = {k: totals[k] + terms[k].item() for k in totals}
        if "expert_counts" in terms:  # MoE: top-k picks (L, E), summed over micro-batches
            picks = terms["expert_counts"].detach() + (picks if i else 0.0)
            dropped = terms["expert_dropped"] + (dropped if i else 0.0)  # (L,) pairs past capacity
    count = max(totals["count"], 1)
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= count
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    out = {"loss": totals["loss_sum"] / count, "accuracy": totals["correct"] / count, "grad_norm": float(grad_norm), "lr": lr}
    if "router_aux_sum" in totals:
        from torch_ref.nn.moe import load_metrics

        out.update(router_aux=totals["router_aux_sum"] / count, router_z=totals["router_z_sum"] / count,
                   **load_metrics(picks, dropped))
    return out


def train(model: nn.Module, tc: TrainConfig, task, steps: int | None = None) -> list[dict]:
    """``steps`` (default tc.steps) updates on ``task.batch(tc, step)``: the torch side's training loop.
    Per-step metrics, each with ``seconds``: that update's wall time (its batch included)."""
    opt, sched = make_optimizer(model, tc)
    out = []
    for s in range(tc.steps if steps is None else steps):
        t = time.perf_counter()
        m = train_step(model, opt, sched, tc, task.batch(tc, s))
        out.append(m | {"seconds": time.perf_counter() - t})
    return out
