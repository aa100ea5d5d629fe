"""Mixture-of-Experts feed-forward network (Mixtral, Qwen2-MoE): a router and SwiGLU experts.

router (Linear, no bias) -> float32 softmax over all experts -> top-k -> optional renormalisation
of the k weights (``MoEConfig.norm_topk``) -> each token's output is the weighted sum of its k
experts' SwiGLU outputs (+ a shared expert scaled by sigmoid(shared_expert_gate(x))). Dropless,
unless impl 'alltoall' has a ``capacity_factor``.

Three implementations of the same math (``MoEConfig.impl``), and 'auto', the default: 'grouped' in
a program lowered for CUDA or TPU, 'dense' on the CPU (and ROCm), per lowering platform (kernels/policy.py):
- 'dense': every expert on every token, one einsum per projection, combined with the (N, E)
  routing matrix that is zero off the top-k. E/k times the useful FLOPs, but no gathers: exact
  and the fastest on a CPU for a few experts.
- 'grouped': the N*k (token, expert) pairs sorted by expert and multiplied group by group with
  ``jax.lax.ragged_dot``, then scattered back with their weights. k/E of the dense FLOPs where
  ragged_dot has a grouped kernel (GPU); on the CPU it lowers to a masked dense product; in a
  program lowered for a TPU, megablox's Pallas grouped matmul (kernels/tpu_gmm.py).
- 'alltoall' (jaxgpt/nn/moe_dispatch.py): per-expert capacity buffers; under a mesh with an
  'expert' axis they travel to the experts' devices by all-to-all (expert parallelism). The only
  one that takes ``MoEConfig.capacity_factor`` (tokens past an expert's capacity are dropped).

The router statistics of the auxiliary losses are sown into the 'router' collection
(``apply(..., mutable=['router'])``; a no-op otherwise): per layer the top-k counts and the
summed probabilities per expert, the summed squared logsumexp (z-loss), the row count and the
(token, expert) pairs dropped by a capacity factor (0 when dropless).
``router_losses`` turns them into Mixtral's load-balancing loss and the ST-MoE z-loss.

Parameters (Flax layout (in, out) per expert; torch_ref stores the very same arrays):
router/kernel (d, E); experts/gate_proj, experts/up_proj (E, d, f); experts/down_proj (E, f, d);
shared_expert/{gate,up,down}_proj/kernel and shared_expert_gate/kernel (d, 1) when shared_d_ff > 0.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.nn.kernels import policy
from jaxgpt.nn.kernels.tpu_gmm import grouped_dot
from jaxgpt.nn.mlp import SwiGLU, dense
from jaxgpt.nn.moe_dispatch import experts_alltoall
from jaxgpt.nn.kernels.precision import module_scope


def route(logits, top_k: int, norm_topk: bool):
    """logits (N, E) -> (probs (N, E) float32, top-k weights (N, k) float32, expert ids (N, k)).

    The softmax comes first (over all experts) and top-k second, as in transformers; top-k over
    the logits first (MaxText's get_topk) equals this only when the weights are renormalised.
    Ties go to the lower expert index (jax.lax.top_k); torch documents no tie order.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, top_k)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return probs, weights, idx


def combine_matrix(weights, idx, n_experts: int):
    """(N, k) weights and ids -> (N, E): each token's weight per expert, zero off its top-k."""
    return jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(idx, n_experts, dtype=weights.dtype))


def experts_dense(x, gate, up, down, weights, idx):
    """All experts on all tokens. x (N, d); gate/up (E, d, f); down (E, f, d) -> (N, d)."""
    comb = combine_matrix(weights, idx, gate.shape[0]).astype(x.dtype)  # (N, E)
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x, gate)) * jnp.einsum("nd,edf->enf", x, up)  # (E, N, f)
    y = jnp.einsum("enf,efd->end", h, down)  # (E, N, d)
    return jnp.einsum("end,ne->nd", y, comb)


def experts_grouped(x, gate, up, down, weights, idx):
    """The (token, expert) pairs sorted by expert, one ragged_dot per projection. Same shapes as
    experts_dense; the result equals it to rounding (different summation order)."""
    n, k = idx.shape
    n_experts = gate.shape[0]
    flat = idx.reshape(-1)  # (N k,) expert of each pair, token-major
    order = jnp.argsort(flat, stable=True)
    token = order // k  # (N k,) token of each sorted pair
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # (E,) pairs per expert
    xs = x[token]  # (N k, d)
    h = jax.nn.silu(grouped_dot(xs, gate, sizes)) * grouped_dot(xs, up, sizes)  # (N k, f)
    y = grouped_dot(h, down, sizes) * weights.reshape(-1)[order, None].astype(x.dtype)  # (N k, d)
    return jnp.zeros_like(x).at[token].add(y)


def experts_auto(x, gate, up, down, weights, idx):
    """'grouped' in a program lowered for CUDA or TPU (ragged_dot's grouped kernels: k/E of the dense
    FLOPs), 'dense' elsewhere: faster on the CPU, where ragged_dot is a masked dense product."""
    return policy.by_platform(x, gate, up, down, weights, idx, cuda=experts_grouped, tpu=experts_grouped,
                              default=experts_dense)


EXPERT_IMPLS = {"auto": experts_auto, "dense": experts_dense, "grouped": experts_grouped}


class Experts(nn.Module):
    """n_experts SwiGLU networks stored as stacked (E, in, out) arrays."""

    n_experts: int
    d_model: int
    d_ff: int
    init_std: float = 0.02
    out_init_std: float = 0.02
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self):
        e, d, f, pd = self.n_experts, self.d_model, self.d_ff, self.param_dtype
        gate = self.param("gate_proj", nn.initializers.normal(self.init_std), (e, d, f), pd)
        up = self.param("up_proj", nn.initializers.normal(self.init_std), (e, d, f), pd)
        down = self.param("down_proj", nn.initializers.normal(self.out_init_std), (e, f, d), pd)
        return gate, up, down


class MoE(nn.Module):
    """Sparse feed-forward network of a ModelConfig with ``moe`` set. x: (..., d_model) -> (..., d_model)."""

    config: object  # ModelConfig

    @nn.compact
    @module_scope
    def __call__(self, x):
        cfg, moe = self.config, self.config.moe
        dt = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        shape = x.shape
        x = jnp.asarray(x).reshape(-1, shape[-1])  # (N, d); a jax array: the experts index it with tracers
        logits = dense(moe.n_experts, False, cfg.init_std, "router", **dt)(x)  # (N, E)
        probs, weights, idx = route(logits, moe.top_k, moe.norm_topk)
        gate, up, down = Experts(moe.n_experts, cfg.d_model, cfg.expert_dim, cfg.init_std, cfg.out_init_std,
                                 cfg.param_dtype, name="experts")()
        cast = lambda a: a.astype(cfg.dtype)
        if moe.impl == "alltoall":
            y, dropped = experts_alltoall(x, cast(gate), cast(up), cast(down), weights, idx, moe.capacity_factor)
        else:
            y, dropped = EXPERT_IMPLS[moe.impl](x, cast(gate), cast(up), cast(down), weights, idx), 0
        if moe.shared_d_ff:
            shared = SwiGLU(cfg.d_model, moe.shared_d_ff, False, cfg.init_std, cfg.out_init_std, name="shared_expert",
                            **dt)(x)
            y = y + jax.nn.sigmoid(dense(1, False, cfg.init_std, "shared_expert_gate", **dt)(x)) * shared
        lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        self.sow("router", "stats", {
            "counts": jax.nn.one_hot(idx, moe.n_experts, dtype=jnp.float32).sum((0, 1)),  # (E,) top-k picks
            "probs": probs.sum(0),  # (E,)
            "z": jnp.sum(lse ** 2), "rows": jnp.asarray(x.shape[0], jnp.float32),
            "dropped": jnp.asarray(dropped, jnp.float32)})  # () pairs past their expert's capacity
        return y.reshape(shape)


def router_losses(router_collection, n_experts: int, scope: str = "pooled"):
    """The 'router' collection of one forward pass -> (load-balancing loss, z-loss), float32 scalars.

    Load balancing (Switch Transformer, eq. 4-6): E * sum_e f_e * P_e, with f_e the share of the
    top-k picks (summing to k) and P_e the mean router probability of expert e. ``scope``
    (MoEConfig.aux_loss_scope) 'pooled': f and P over every row of every layer, transformers'
    ``load_balancing_loss_func``; 'layer': f and P per layer, the layers' losses averaged.
    z-loss (ST-MoE): the mean over rows and layers of logsumexp(router logits)^2.
    """
    stats = _stats(router_collection)
    if not stats:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero
    counts = jnp.concatenate([s["counts"].reshape(-1, n_experts) for s in stats])  # (L, E)
    probs = jnp.concatenate([s["probs"].reshape(-1, n_experts) for s in stats])  # (L, E)
    rows = jnp.concatenate([s["rows"].reshape(-1) for s in stats])  # (L,)
    z = sum(s["z"].sum() for s in stats) / rows.sum()
    if scope == "layer":
        return n_experts * jnp.mean(jnp.sum(counts * probs, -1) / rows ** 2), z
    if scope != "pooled":
        raise ValueError(f"aux_loss_scope={scope!r} is not 'pooled' or 'layer'")
    return n_experts * jnp.sum(counts.sum(0) / rows.sum() * probs.sum(0) / rows.sum()), z


def _stats(router_collection) -> list[dict]:
    return jax.tree.leaves(router_collection, is_leaf=lambda v: isinstance(v, dict) and "counts" in v)


def expert_counts(router_collection, n_experts: int):
    """The 'router' collection of one forward pass -> (L, E) float32: each MoE layer's top-k picks
    per expert (the per-expert load; layers in the collection's order)."""
    return jnp.concatenate([s["counts"].reshape(-1, n_experts) for s in _stats(router_collection)])


def expert_dropped(router_collection):
    """The 'router' collection of one forward pass -> (L,) float32: each MoE layer's (token, expert)
    pairs dropped by the capacity factor (moe_dispatch; zeros when dropless)."""
    return jnp.concatenate([s["dropped"].reshape(-1) for s in _stats(router_collection)])


def load_metrics(counts, dropped=None) -> dict:
    """(L, E) top-k picks -> {'expert_load': (E,) each expert's share of its layer's picks, averaged
    over layers (1 / E each when balanced), 'expert_load_max': the busiest expert's share in any
    layer over its fair share 1 / E (1.0 = balanced)}; with ``dropped`` ((L,) pairs past capacity),
    'expert_dropped': their share of all layers' top-k pairs (0.0 when dropless)."""
    share = counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0)
    out = {"expert_load": share.mean(0), "expert_load_max": share.max() * counts.shape[-1]}
    if dropped is not None:
        out["expert_dropped"] = dropped.sum() / jnp.maximum(counts.sum(), 1.0)
    return out
