"""What a training run decides once, before its first update (``make_plan``): the mesh, the compiled
train and eval programs, how many updates one call runs, and how a host batch reaches the devices.
``fit`` builds one plan and every part of the loop reads it, so ``TrainConfig.mesh`` is resolved
once a run (``resolve_mesh``), and the train and eval steps run on the same mesh.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.train.compiled import compile_ahead
from jaxgpt.train.step import TrainState, abstract_state, make_eval_step, make_train_step, make_train_steps
from jaxgpt.train.tasks import Task


def resolve_mesh(tc: TrainConfig):
    """The jax Mesh of ``tc.mesh``: '' -> None (the single-device path, unchanged); 'auto' ->
    ``sharding.auto_mesh`` (this host's CPU devices, when the batch rows divide); a spec ->
    ``sharding.make_mesh``. The one place a run turns its TrainConfig into devices."""
    if not tc.mesh:
        return None
    from jaxgpt.parallel.sharding import train_mesh

    return train_mesh(tc)


def placer(mesh) -> Callable[[dict, int], dict]:
    """Host batch -> global arrays on ``mesh``, rows split over ('data', 'fsdp', 'expert'), each
    process handing over its own rows: ``lead`` axes before the rows (``sharding.batch_sharding``:
    2 for a chunk of train batches, 1 for one). Eval batches (``lead=0``) too when their rows divide,
    else replicated (a short last batch of a classification set). No mesh: the batch as it is."""
    if mesh is None:
        return lambda batch, lead: batch
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.config.mesh import batch_devices
    from jaxgpt.parallel.sharding import shard_batch

    rows = batch_devices(mesh.shape)

    def place(batch: dict, lead: int) -> dict:
        if lead or all(len(x) % rows == 0 for x in batch.values()):
            return shard_batch(batch, mesh, lead)
        whole = NamedSharding(mesh, PartitionSpec())
        return {k: jax.make_array_from_process_local_data(whole, np.asarray(x)) for k, x in batch.items()}

    return place


def chunk_shapes(task: Task, tc: TrainConfig, k: int, mesh) -> dict:
    """Shapes of a call's stacked batches, (k, grad_accum, micro_batch, ...), as ``fit`` places them."""
    sharding = None
    if mesh is not None:
        from jaxgpt.parallel.sharding import batch_sharding

        sharding = batch_sharding(mesh, lead=2)
    return {key: jax.ShapeDtypeStruct((k, *np.shape(x)), np.asarray(x).dtype, sharding=sharding)
            for key, x in task.batch(tc, 0).items()}


@dataclass
class Plan:
    mesh: Any  # a jax Mesh, or None: one device
    k: int  # updates per call: ``step`` is make_train_steps' program when k > 1, else one update's
    step: Callable
    eval_step: Callable
    place: Callable[[dict, int], dict]  # placer(mesh)
    abstract: TrainState | None  # the state's shapes and shardings (k > 1: what compile_ahead compiled for)
    ahead: threading.Thread | None  # compiling ``step`` meanwhile (compile_ahead); join before the first call

    @property
    def multi(self) -> bool:
        return self.k > 1

    @property
    def lead(self) -> int:
        """Axes before a placed batch's rows: (k, A, B, ...) for a chunk, (A, B, ...) for one batch."""
        return 2 if self.multi else 1

    def run(self, state: TrainState, batches: dict, n: int):
        """The call's ``n`` updates: (state, metrics), metrics (k,)-stacked when ``multi``."""
        return self.step(state, batches, np.int32(n)) if self.multi else self.step(state, batches)


def make_plan(config, tc: TrainConfig, task: Task, *, train_step=None, eval_step=None) -> Plan:
    """The run's plan. ``train_step``: a caller's compiled one-update step (``make_train_step``), e.g.
    shared by the seeds of one model; then each call runs one update. Otherwise
    ``tc.updates_per_call`` updates a call, compiled on a thread (with a persistent compile cache)
    while the caller initialises the state."""
    mesh = resolve_mesh(tc)
    k = 1 if train_step is not None else tc.updates_per_call
    abstract = ahead = None
    if k > 1:
        step = make_train_steps(config, tc, k, mesh=mesh)
        abstract = abstract_state(config, tc, mesh)
        ahead = compile_ahead(step, abstract, chunk_shapes(task, tc, k, mesh), jax.ShapeDtypeStruct((), np.int32))
    else:
        step = train_step or make_train_step(config, tc, mesh=mesh)
    return Plan(mesh=mesh, k=k, step=step, eval_step=eval_step or make_eval_step(config, mesh=mesh, execution=tc.execution),
                place=placer(mesh), abstract=abstract, ahead=ahead)


__all__ = ["Plan", "chunk_shapes", "make_plan", "placer", "resolve_mesh"]
