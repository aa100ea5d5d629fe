"""What a training run decides once, before its first update (``make_plan``): the mesh, the compiled
train and eval programs, and how a host batch reaches the devices. ``fit`` builds one plan and every
part of the loop reads it: ``TrainConfig.mesh`` is resolved here (``train.mesh.resolve_mesh``), and the
train and eval programs, the state and the batches all get that one ``Mesh`` or None.

One program form: ``k >= 1`` updates a call (``make_train_steps``; one update a call is k = 1), on a
chunk of k stacked batches, its metrics ``(k,)``-stacked.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgpt.config import TrainConfig
from jaxgpt.config.mesh import batch_devices
from jaxgpt.data.task import Task
from jaxgpt.parallel.sharding import batch_sharding, shard_batch
from jaxgpt.train.compiled import compile_ahead
from jaxgpt.train.mesh import resolve_mesh
from jaxgpt.train.step import TrainState, abstract_state, make_eval_step, make_train_steps

CHUNK = 2  # a placed chunk's axes before its rows: (k, grad_accum, rows, ...)


def placer(mesh: Mesh | None) -> Callable[[dict, int], dict]:
    """Host batch -> global arrays on ``mesh``, rows split over ('data', 'fsdp', 'expert'), each
    process handing over its own rows: ``lead`` axes before the rows (``sharding.batch_sharding``:
    2 for a chunk of train batches, 1 for one). Eval batches (``lead=0``) too when their rows divide,
    else replicated (a short last batch of a classification set). No mesh: the batch as it is."""
    if mesh is None:
        return lambda batch, lead: batch
    rows = batch_devices(mesh.shape)

    def place(batch: dict, lead: int) -> dict:
        if lead or all(len(x) % rows == 0 for x in batch.values()):
            return shard_batch(batch, mesh, lead)
        whole = NamedSharding(mesh, PartitionSpec())
        return {k: jax.make_array_from_process_local_data(whole, np.asarray(x)) for k, x in batch.items()}

    return place


def chunk_shapes(task: Task, tc: TrainConfig, k: int, mesh: Mesh | None) -> dict:
    """Shapes of a call's stacked batches, (k, grad_accum, micro_batch, ...), as ``fit`` places them."""
    sharding = None if mesh is None else batch_sharding(mesh, lead=CHUNK)
    return {key: jax.ShapeDtypeStruct((k, *np.shape(x)), np.asarray(x).dtype, sharding=sharding)
            for key, x in task.batch(tc, 0).items()}


@dataclass
class Plan:
    mesh: Mesh | None  # None: one device
    k: int  # updates per call (>= 1): ``step`` runs make_train_steps' program on chunks of k batches
    step: Callable  # step(state, chunk, n) -> (state, metrics (k,)-stacked)
    eval_step: Callable
    place: Callable[[dict, int], dict]  # placer(mesh)
    abstract: TrainState | None  # the state's shapes and shardings (what compile_ahead compiled for)
    ahead: threading.Thread | None  # compiling ``step`` meanwhile (compile_ahead); join before the first call

    def run(self, state: TrainState, chunk: dict, n: int):
        """The first ``n`` updates of a host ``chunk`` (k, grad_accum, micro_batch, ...), placed on the
        mesh: (state, metrics), each metric (k,)-stacked."""
        return self.step(state, self.place(chunk, CHUNK), np.int32(n))


def make_plan(config, tc: TrainConfig, task: Task, *, train_steps=None, eval_step=None) -> Plan:
    """The run's plan: ``tc.updates_per_call`` updates a call. ``train_steps``: a caller's compiled
    ``make_train_steps(config, tc, tc.updates_per_call)`` program, e.g. shared by the seeds of one model;
    otherwise the program is built here and compiled on a thread (with a persistent compile cache) while
    the caller initialises the state."""
    mesh, k = resolve_mesh(tc), tc.updates_per_call
    abstract = ahead = None
    if train_steps is None:
        train_steps = make_train_steps(config, tc, k, mesh=mesh)
        abstract = abstract_state(config, tc, mesh)
        ahead = compile_ahead(train_steps, abstract, chunk_shapes(task, tc, k, mesh), jax.ShapeDtypeStruct((), np.int32))
    return Plan(mesh=mesh, k=k, step=train_steps, eval_step=eval_step or make_eval_step(config, mesh=mesh, execution=tc.execution),
                place=placer(mesh), abstract=abstract, ahead=ahead)


__all__ = ["CHUNK", "Plan", "chunk_shapes", "make_plan", "placer", "resolve_mesh"]
