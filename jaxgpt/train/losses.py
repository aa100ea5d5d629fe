"""Losses shared by every model kind: token cross entropy with an ignore index, returned as a
(sum, count) pair so that micro-batches and eval batches combine into an exact token mean."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.nn import checks
from jaxgpt.core import validate
from jaxgpt.core.constants import DOCUMENT_KEYS, IGNORE_INDEX, batch_keys
from jaxgpt.models import build

def cross_entropy(logits, targets, ignore_index: int = IGNORE_INDEX):
    """logits (..., V), targets (...) int -> (sum of -log p(target), number of kept targets,
    number of kept targets that are the argmax). Computed in float32 like torch's F.cross_entropy.
    Targets must be in [0, V) or ``ignore_index`` (JAX would score -1 as class V-1, and V as NaN):
    a ValueError when concrete, a checked-mode check (``jaxgpt.nn.checks``) when traced."""
    if checks.is_traced(targets):
        checks.check_in_range(targets, logits.shape[-1], "target", space="", allow=ignore_index)
    else:
        validate.check_targets(targets, logits.shape[-1], ignore_index=ignore_index)
    logits = logits.astype(jnp.float32)
    keep = targets != ignore_index
    safe = jnp.where(keep, targets, 0)  # any valid index; the term is zeroed below
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    nll = jnp.where(keep, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    correct = keep & (jnp.argmax(logits, axis=-1) == targets)
    return nll.sum(), keep.sum(), correct.sum()


def loss_terms(config, params, batch: dict, *, rng=None, train: bool = False, execution=None) -> dict:
    """Forward pass + cross entropy on one batch -> {'loss_sum', 'count', 'correct'} scalars.

    Language models: next-token loss over y != IGNORE_INDEX; a batch's 'segment_ids' and
    'positions' (TrainConfig.documents) go to the model. Classifiers: one label per row.
    Encoder-decoder: teacher-forced loss over labels != IGNORE_INDEX. ``train`` turns dropout on
    (then ``rng`` is required). Mixture-of-Experts models add 'router_aux_sum' and 'router_z_sum':
    this batch's load-balancing and z losses (jaxgpt.nn.moe.router_losses) times ``count``, so
    that micro-batches combine like the cross entropy, and 'expert_counts' (L, E), each MoE layer's
    top-k picks per expert, and 'expert_dropped' (L,), each MoE layer's (token, expert) pairs past
    their expert's capacity (``MoEConfig.capacity_factor``; zeros when dropless), both summed over
    micro-batches and devices like the rest. ``execution``: the model's Execution (None: the default).
    """
    *inputs, targets = (batch[k] for k in batch_keys(config))
    docs = {k: batch[k] for k in DOCUMENT_KEYS if k in batch}  # packed documents (jaxgpt.data.documents)
    rngs = {"dropout": rng} if train else {}
    moe = getattr(config, "moe", None)
    if moe is None:
        logits = build(config, execution).apply({"params": params}, *inputs, deterministic=not train, rngs=rngs, **docs)
    else:
        logits, state = build(config, execution).apply({"params": params}, *inputs, deterministic=not train, rngs=rngs,
                                            mutable=["router"], **docs)
    loss_sum, count, correct = cross_entropy(logits, targets)
    terms = {"loss_sum": loss_sum, "count": count, "correct": correct}
    if moe is not None:
        from jaxgpt.nn.moe import expert_counts, expert_dropped, router_losses

        aux, z = router_losses(state.get("router", {}), moe.n_experts, moe.aux_loss_scope)
        terms.update(router_aux_sum=aux * count, router_z_sum=z * count,
                     expert_counts=expert_counts(state.get("router", {}), moe.n_experts),
                     expert_dropped=expert_dropped(state.get("router", {})))
    return terms


def objective(terms: dict, tc, config) -> jax.Array:
    """The summed training objective of ``loss_terms``: cross entropy + the router losses times their
    coefficients (MoE models: ``tc.aux_coef(config)``, ``tc.router_z_coef``); divided by the token count it
    is the mean loss optimised."""
    out = terms["loss_sum"]
    if "router_aux_sum" in terms:
        out = out + tc.aux_coef(config) * terms["router_aux_sum"] + tc.router_z_coef * terms["router_z_sum"]
    return out
