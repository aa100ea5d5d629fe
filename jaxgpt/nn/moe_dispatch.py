"""Expert-parallel MoE dispatch (``MoEConfig.impl='alltoall'``): GShard's capacity buffers, moved to
the devices that hold their experts with ``jax.lax.all_to_all``, and an optional capacity factor.

Groups. The tokens are split into groups, and each group fills one buffer per expert: ``capacity``
slots of d_model. Under a mesh whose 'expert' axis is > 1 (the ambient mesh inside jit:
``jax.sharding.get_abstract_mesh()``, which ``parallel.sharding.constrain_activations`` sets around the
sharded train step's forward), a group is one device's rows (the batch is split over ('data', 'fsdp',
'expert')), and the step is a ``shard_map``: each device fills its (E, C, d) buffers, one all-to-all over
'expert' sends expert e's buffer to the device holding e (each holds E / expert experts), every device
runs its experts on what it received (expert x C x sources tokens each), and a second all-to-all sends
the outputs back, where each token sums its k outputs with its routing weights. Without such a mesh
(one device, a 'data'-only mesh, eval, the torch mirror) the whole batch is one group and nothing is
sent: the same config runs everywhere. Expert weights enter the shard_map split by expert only, so
an 'fsdp' or 'tensor' split of them is gathered at its boundary (and their gradients reduce-scattered
back) by XLA.

Why a third ``impl`` and not automatic under an expert mesh: a capacity factor makes the result depend
on the groups (a buffer's size scales with its group), so which tokens are dropped depends on the
mesh; choosing 'alltoall' is choosing that. Dropless (``capacity_factor=None``, the default), it is the
dense and grouped impls' math on every mesh (tests: parity_tests/unit/test_moe_dispatch.py).

Capacity. ``capacity_factor=None``: C = the group's token count (a token picks an expert at most once,
so nothing can overflow). With a factor f: C = ceil(f * tokens_in_group * top_k / n_experts), at most the
group's token count (a larger buffer could never fill). Priority within a group, per expert: every
token's first choice before any token's second choice (GShard, Switch), and within one choice rank the
earlier token (the group's rows in order, each row's positions in order). A (token, expert) pair past
its expert's C is dropped: that expert's weighted output is 0 for the token (the other k weights are
not renormalised; the residual stream carries the token). The dropped pairs are counted and sown with
the router statistics ('dropped'), and the train step reports their share of all top-k pairs as
``expert_dropped``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgpt.config.mesh import BATCH_AXES


def capacity(tokens: int, top_k: int, n_experts: int, factor: float | None) -> int:
    """Slots per (group, expert) for a group of ``tokens`` tokens (see the module docstring)."""
    if factor is None:
        return tokens
    return min(tokens, math.ceil(factor * tokens * top_k / n_experts))


def slots(idx, n_experts: int, cap: int):
    """(N, k) expert ids of one group -> (N, k) int32 buffer slot of each pair, and (N, k) bool kept
    (slot < cap). Slots are counted per expert in priority order: choice rank first, then token."""
    n, k = idx.shape
    onehot = jax.nn.one_hot(idx.T.reshape(-1), n_experts, dtype=jnp.int32)  # (k N, E): rank-major order
    pos = (jnp.cumsum(onehot, axis=0) - 1) * onehot  # (k N, E): place in the expert's queue
    pos = pos.sum(-1).reshape(k, n).T  # (N, k)
    return pos, pos < cap


def swiglu_experts(h, gate, up, down):
    """h (E, M, d) tokens per expert; gate/up (E, d, f); down (E, f, d) -> (E, M, d)."""
    a = jax.nn.silu(jnp.einsum("emd,edf->emf", h, gate)) * jnp.einsum("emd,edf->emf", h, up)
    return jnp.einsum("emf,efd->emd", a, down)


def _group(x, gate, up, down, weights, idx, factor, axis: str | None, n_axis: int):
    """One group's dispatch, expert compute and combine. Inside the shard_map, ``axis`` is the
    expert mesh axis (n_axis devices, each with E / n_axis experts); None: every expert is here.
    -> (y (N, d), dropped pairs (), int32)."""
    n, d = x.shape
    k = idx.shape[1]
    e = gate.shape[0] * n_axis
    cap = capacity(n, k, e, factor)
    pos, keep = slots(idx, e, cap)
    flat = jnp.where(keep, idx * cap + pos, e * cap).reshape(-1)  # (N k,): e*cap = dropped, off the end
    buf = jnp.zeros((e * cap, d), x.dtype).at[flat].add(jnp.repeat(x, k, axis=0), mode="drop")  # (E C, d)
    if axis is None:
        out = swiglu_experts(buf.reshape(e, cap, d), gate, up, down)  # (E, C, d)
    else:
        el = e // n_axis
        # (X, E/X, C, d): block j goes to device j of the axis; received, block i came from device i
        recv = jax.lax.all_to_all(buf.reshape(n_axis, el, cap, d), axis, 0, 0, tiled=True)
        h = recv.transpose(1, 0, 2, 3).reshape(el, n_axis * cap, d)  # (E/X, X C, d): this device's experts
        y = swiglu_experts(h, gate, up, down).reshape(el, n_axis, cap, d).transpose(1, 0, 2, 3)
        out = jax.lax.all_to_all(y, axis, 0, 0, tiled=True)  # (X, E/X, C, d): back to the tokens' devices
    pairs = out.reshape(e * cap, d).at[flat].get(mode="fill", fill_value=0)  # (N k, d); 0 where dropped
    w = (weights * keep).astype(x.dtype)  # (N, k)
    y = jnp.einsum("nkd,nk->nd", pairs.reshape(n, k, d), w)
    return y, jnp.sum(~keep, dtype=jnp.int32)


def expert_mesh():
    """The ambient (abstract) mesh when it has an 'expert' axis > 1 not already manual (inside a
    shard_map over it); else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("expert", 1) < 2 or "expert" in getattr(mesh, "manual_axes", ()):
        return None
    return mesh


def experts_alltoall(x, gate, up, down, weights, idx, factor: float | None = None):
    """x (N, d); gate/up (E, d, f); down (E, f, d); weights/idx (N, k) -> (y (N, d), dropped pairs
    () int32, summed over groups). Under an expert mesh: one group per device and two all-to-alls
    (module docstring); else one group, no collective."""
    mesh = expert_mesh()
    if mesh is None:
        return _group(x, gate, up, down, weights, idx, factor, None, 1)
    n_axis, e = mesh.shape["expert"], gate.shape[0]
    groups = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if e % n_axis:
        raise ValueError(f"moe.impl='alltoall' splits the experts over the mesh's expert axis: n_experts={e} is "
                         f"not a multiple of expert={n_axis}; use an expert size that divides {e}")
    if x.shape[0] % groups:
        raise ValueError(f"moe.impl='alltoall' makes one token group per device: {x.shape[0]} tokens do not split "
                         f"over data*fsdp*expert={groups} devices")

    def local(x, gate, up, down, weights, idx):
        y, dropped = _group(x, gate, up, down, weights, idx, factor, "expert", n_axis)
        return y, jax.lax.psum(dropped, BATCH_AXES)  # over every group

    rows, experts = P(BATCH_AXES), P("expert")
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, experts, experts, experts, rows, rows),
                         out_specs=(rows, P()))(x, gate, up, down, weights, idx)


__all__ = ["capacity", "experts_alltoall", "expert_mesh", "slots", "swiglu_experts"]
