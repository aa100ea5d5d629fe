"""Data parallelism with one explicit all-reduce: the gradient of a replicated-parameter step as a
``shard_map`` over the batch axes, every device's sums flattened into one buffer per dtype and
summed with one ``psum``.

Why not leave it to GSPMD, as every other mesh does: on XLA:CPU's in-process collectives an
all-reduce has a fixed cost per buffer, and GSPMD reduces the gradient as a tuple of one buffer per
parameter (docs/performance.md, the data-parallelism row, has the figures). It also all-reduces the
target count as soon as the forward computes it, a sync point in the middle of the step where the
faster device waits for the slower. Here the step's only collective comes at the end. The arithmetic
is GSPMD's (each device sums its rows, the devices' sums are added), so the update matches the
one-device step to float32 rounding. The token counts travel in the same float32 buffer (exact below
2^24 tokens a step).

Used by ``train.step.make_train_step`` when every parameter and optimizer state is replicated
(a 'data'-only mesh, e.g. ``TrainConfig.mesh='auto'`` on a CPU host) and the model draws no dropout:
dropout masks are drawn for the global batch, which a per-device program does not see.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgpt.config.mesh import BATCH_AXES


def psum_flat(tree, axes, int_bound: int | None = None):
    """``jax.lax.psum(tree, axes)`` as one all-reduce per dtype: the leaves raveled into one vector.

    int_bound: a bound on every integer leaf's sum (the step passes its global token count). Below
    2^24, where float32 holds every integer exactly, the integers travel in the float32 buffer, so
    the devices meet once, at the end: on their own, XLA scheduled their all-reduce (it needs only
    the batch) in the middle of the forward, where the first device to arrive waited for the other
    (an ``optimization_barrier`` did not move it: XLA:CPU drops barriers)."""
    leaves, treedef = jax.tree.flatten(tree)
    has_f32 = any(x.dtype == jnp.float32 for x in leaves)
    carried = [has_f32 and int_bound is not None and int_bound < 2 ** 24 and jnp.issubdtype(x.dtype, jnp.integer)
               for x in leaves]
    work = [x.astype(jnp.float32) if c else x for x, c in zip(leaves, carried)]
    out = list(work)
    for dtype in dict.fromkeys(x.dtype for x in work):  # first-seen order: a set's would differ per process
        idx = [i for i, x in enumerate(work) if x.dtype == dtype]
        flat = jax.lax.psum(jnp.concatenate([jnp.ravel(work[i]) for i in idx]), axes)  # (sum of sizes,)
        offsets = [0]
        for i in idx:
            offsets.append(offsets[-1] + work[i].size)
        for i, lo, hi in zip(idx, offsets, offsets[1:]):
            out[i] = flat[lo:hi].reshape(work[i].shape)
    out = [o.astype(x.dtype) if c else o for o, x, c in zip(out, leaves, carried)]
    return jax.tree.unflatten(treedef, out)


def replicated(shardings) -> bool:
    """Whether every sharding of the pytree keeps its whole array on each device."""
    return all(s.is_fully_replicated for s in jax.tree.leaves(shardings))


def data_parallel(fn, mesh, *, micro_axis: bool = True):
    """``fn(params, batch, *rest) -> sums`` (sums over the batch's rows: gradients of a summed loss,
    token counts) -> the same function over ``mesh``: params and ``rest`` (an rng) replicated, batch
    split by row over ('data', 'fsdp', 'expert'), each device's sums added by ``psum_flat``.
    micro_axis: the batch is (A, B, ...), rows on axis 1 (the train step); else (B, ...) (evaluation)."""
    devices = math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)
    batch_spec = P(None, BATCH_AXES) if micro_axis else P(BATCH_AXES)

    def local(params, batch, *rest):
        tokens = devices * max(x.size for x in jax.tree.leaves(batch))  # bounds every count the step sums
        return psum_flat(fn(params, batch, *rest), BATCH_AXES, int_bound=tokens)

    def run(params, batch, *rest):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), batch_spec, *(P() for _ in rest)), out_specs=P(),
                             check_vma=False)(params, batch, *rest)

    return run


__all__ = ["data_parallel", "psum_flat", "replicated"]
