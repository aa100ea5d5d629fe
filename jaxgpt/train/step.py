"""Train state (a pytree) and the pure, jitted train and eval steps.

``train_step(state, batch) -> (state, metrics)`` is compiled once per batch shape with the state
donated, so params and optimizer moments are updated in place. Every random number derives from
``state.rng`` and ``state.step``, and every batch from (seed, step): a run restored at step s
continues bit for bit as if it had never stopped.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.nn import checks
from jaxgpt.nn.moe import load_metrics
from jaxgpt.config import TrainConfig
from jaxgpt.config.mesh import batch_devices
from jaxgpt.models import abstract_params, init_params
from jaxgpt.parallel.data_parallel import data_parallel, replicated
from jaxgpt.parallel.sharding import batch_sharding, constrain_activations, param_shardings, state_shardings
from jaxgpt.train.compiled import Jit, compiler_options, paced
from jaxgpt.train.mesh import resolve_mesh
from jaxgpt.train.losses import loss_terms, objective
from jaxgpt.train.optim import make_optimizer, schedule


class TrainState(struct.PyTreeNode):
    step: jax.Array  # () int32: updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # (2,) uint32: dropout keys are fold_in(rng, step)

    def to_dict(self) -> dict:
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state, "rng": self.rng}


def init_state(config, tc: TrainConfig, params=None, mesh: Mesh | str | None = "auto") -> TrainState:
    """Step 0: params from ``init_params(config, fold_in(PRNGKey(seed), 0))`` unless given.

    mesh: a ``jaxgpt.parallel.sharding`` mesh: every array is created directly in its sharding by one
    ``jax.jit(..., out_shardings=...)``, never whole on one device (the values do not depend on the
    mesh: JAX's partitionable threefry draws the same numbers however the output is split).
    'auto': ``tc.mesh``'s (``train.mesh.resolve_mesh``), the mesh ``make_train_step`` picks; None: one device."""
    key, mesh = jax.random.PRNGKey(tc.seed), resolve_mesh(tc, mesh)
    if mesh is not None:
        def fresh(p):
            p = init_params(config, jax.random.fold_in(key, 0), tc.execution) if p is None else p
            return TrainState(step=jnp.int32(0), params=p, opt_state=make_optimizer(tc).init(p),
                              rng=jax.random.fold_in(key, 1))

        shardings = state_shardings(config, jax.eval_shape(fresh, params), mesh)
        if params is not None:  # given weights: placed shard by shard, then the optimizer state made in place
            params = jax.device_put(params, shardings.params)
        return jax.jit(fresh, out_shardings=shardings)(params)
    if params is None:
        params = jax.jit(init_params, static_argnums=(0, 2))(config, jax.random.fold_in(key, 0), tc.execution)
    params = jax.tree.map(jnp.asarray, params)
    return TrainState(step=jnp.int32(0), params=params, opt_state=make_optimizer(tc).init(params),
                      rng=jax.random.fold_in(key, 1))


def abstract_state(config, tc: TrainConfig, mesh: Mesh | None = None) -> TrainState:
    """Shapes and dtypes of ``init_state`` (jax.eval_shape: nothing allocated), the restore target;
    with ``mesh``, each ShapeDtypeStruct also carries its sharding (restores land split)."""
    return jax.tree.map(lambda x: x, _abstract_state(config, tc, mesh))  # fresh containers: callers may edit


@functools.lru_cache(maxsize=32)  # a trace of init, asked for by every checkpoint read-back
def _abstract_state(config, tc: TrainConfig, mesh: Mesh | None) -> TrainState:
    shapes = jax.eval_shape(lambda: init_state(config, tc, mesh=None))  # shapes only: no mesh to decide
    if mesh is None:
        return shapes
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        state_shardings(config, shapes, mesh))


def _row_sums(config) -> bool:
    """Whether the objective is a sum over rows computed row by row: no dropout (its masks are drawn
    for the whole batch) and no router losses (MoE: a product of batch-wide means)."""
    def dropout(d: dict) -> bool:
        return any(dropout(v) if isinstance(v, dict) else "dropout" in k and bool(v) for k, v in d.items())
    return getattr(config, "moe", None) is None and not dropout(config.to_dict())


def _split(mesh: Mesh | None, rows: int) -> bool:
    """Whether a batch of ``rows`` rows is split over ``mesh``'s batch axes (rows that do not divide run
    whole on each device)."""
    return mesh is not None and rows % batch_devices(mesh.shape) == 0


def _gradients(config, tc: TrainConfig, mesh: Mesh | None):
    """-> ``accumulate(params, batch, rng, spmd=True) -> (grads, terms)``: gradients of the summed objective
    and the summed loss terms over the micro-batches (spmd=False: inside data_parallel's shard_map, on
    this device's rows)."""
    def micro_grads(params, micro, rng, spmd=True):
        def f(p):
            rows = jax.tree.leaves(micro)[0].shape[0]
            if not spmd or not _split(mesh, rows):
                terms = loss_terms(config, p, micro, rng=rng, train=True, execution=tc.execution)
            else:  # activations split by row: FSDP weights are then gathered layer by layer in the scan
                with constrain_activations(mesh, rows):
                    terms = loss_terms(config, p, micro, rng=rng, train=True, execution=tc.execution)
            return objective(terms, tc, config), terms
        return jax.grad(f, has_aux=True)(params)

    def accumulate(params, batch, rng, spmd=True):
        n_micro = jax.tree.leaves(batch)[0].shape[0]
        if n_micro == 1:
            return micro_grads(params, jax.tree.map(lambda a: a[0], batch), rng, spmd)

        def body(acc, xs):
            i, micro = xs
            g, t = micro_grads(params, micro, jax.random.fold_in(rng, i), spmd)
            return jax.tree.map(jnp.add, acc, (g, t)), None

        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(functools.partial(micro_grads, spmd=spmd), params,
                                                            jax.tree.map(lambda a: a[0], batch), rng))
        return jax.lax.scan(body, zeros, (jnp.arange(n_micro), batch))[0]

    return accumulate


def _update(config, tc: TrainConfig):
    """-> ``update(state, grads, terms) -> (state, metrics)``: the optimizer step on the summed gradients
    and the update's metrics."""
    optimizer, lr = make_optimizer(tc), schedule(tc)

    def update(state: TrainState, grads, terms: dict):
        count = jnp.maximum(terms["count"], 1)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(terms["loss_sum"]) & jnp.isfinite(grad_norm)
        if tc.on_nonfinite == "skip":
            # The state is donated, so the old one survives only if the choice is made in here. An
            # update that overflows (huge lr) counts as non-finite too: weights never become inf.
            finite &= jnp.isfinite(optax.tree.norm(updates))
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": terms["loss_sum"] / count, "accuracy": terms["correct"] / count,
                   "grad_norm": grad_norm, "lr": lr(state.step),
                   "nonfinite": 1.0 - finite.astype(jnp.float32)}  # skip: 1 = this update was skipped
        if "router_aux_sum" in terms:  # MoE: the router losses (token means), not in 'loss'
            metrics.update(router_aux=terms["router_aux_sum"] / count, router_z=terms["router_z_sum"] / count,
                           # per-expert load: expert_load (E,), _max; expert_dropped: share of top-k pairs dropped
                           **load_metrics(terms["expert_counts"], terms["expert_dropped"]))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return update


def _train_program(config, tc: TrainConfig, mesh: Mesh | None):
    """(the pure ``train_step(state, batch)``, jit's shardings: {} without a mesh). The batch comes as it
    is (host arrays of any row count, or already placed): rows that divide are split over the mesh's
    batch axes in here."""
    accumulate, update = _gradients(config, tc, mesh), _update(config, tc)
    state_sh = None if mesh is None else jax.tree.map(lambda x: x.sharding, abstract_state(config, tc, mesh))
    # replicated state and no dropout: the gradient as one shard_map with one all-reduce (data_parallel.py)
    one_allreduce = mesh is not None and replicated(state_sh) and _row_sums(config)

    def train_step(state: TrainState, batch: dict):
        checks.debug_check_batch(batch, config)  # up front, outside grad: names the key and the micro-batch
        split = _split(mesh, jax.tree.leaves(batch)[0].shape[1])
        if split:
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding(mesh))
        rng = jax.random.fold_in(state.rng, state.step)
        if split and one_allreduce:
            grads, terms = data_parallel(functools.partial(accumulate, spmd=False), mesh)(state.params, batch, rng)
        else:
            grads, terms = accumulate(state.params, batch, rng)
        return update(state, grads, terms)

    if mesh is None:
        return train_step, {}
    return train_step, dict(in_shardings=(state_sh, None), out_shardings=(state_sh, NamedSharding(mesh, P())))


def make_train_step(config, tc: TrainConfig, *, checked: bool = False, mesh: Mesh | str | None = "auto"):
    """-> jitted ``train_step(state, batch) -> (state, metrics)``; ``state`` is donated.
    ``checked``: checked mode (``jaxgpt.nn.checks``): a bad id, target or label raises ValueError
    instead of being clamped or scored silently; off by default (the checks compile away).
    ``mesh``: a ``jaxgpt.parallel.sharding`` mesh: the state keeps its sharding (``init_state(mesh=...)``),
    batch rows are split over ('data', 'fsdp', 'expert') (``sharding.shard_batch`` places them so ahead),
    metrics replicated; jit propagates the rest. None: the single-device step. 'auto' (default):
    ``tc.mesh``'s (``train.mesh.resolve_mesh``); its default 'auto' splits the batch over this host's CPU
    devices (jaxgpt.parallel.host_devices). A batch whose rows do not divide runs whole on each device.
    When the state is replicated and the model draws no dropout, the gradient is computed per device
    and reduced in one all-reduce (``jaxgpt.parallel.data_parallel``).

    batch: the model's batch dict (``losses.BATCH_KEYS``) with a leading micro-batch axis
    (grad_accum, micro_batch, ...). Gradients of the summed loss are accumulated over the
    micro-batches and divided by the total target count, so the update is the one a single
    batch of ``batch_size`` would give. metrics: loss (token mean), accuracy, grad_norm (before
    clipping), lr (of this update), nonfinite (1.0 when the loss or gradient norm is NaN/inf;
    with ``on_nonfinite='skip'`` such an update is not applied: params and optimizer state,
    including its update count, stay as they were).
    """
    mesh = resolve_mesh(tc, mesh)
    train_step, shardings = _train_program(config, tc, mesh)
    options = compiler_options() or None
    if checked:  # checkify returns (error, output): the output shardings are left to propagation
        step = checks.checked(train_step, donate_argnums=0, compiler_options=options,
                              **{k: v for k, v in shardings.items() if k == "in_shardings"})
    else:
        step = Jit(train_step, donate_argnums=0, **shardings)
    # the metrics are what is waited for: the state was donated to the next step
    return paced(step, mesh, keep=lambda out: out[1])


def make_train_steps(config, tc: TrainConfig, k: int, *, mesh: Mesh | str | None = "auto"):
    """-> jitted ``train_steps(state, batches, n) -> (state, metrics)``: the updates of
    ``make_train_step``, one after another, for ``batches[0] .. batches[n - 1]`` in one call: a
    ``fori_loop`` over the same pure ``train_step``, so each update is the one a single step gives.
    ``batches``: ``k`` train batches stacked on a new leading axis, (k, grad_accum, micro_batch, ...);
    ``n`` (1..k) is an argument, not a constant, so one program serves every chunk length (the
    batches after the n-th are ignored). ``metrics``: each of ``make_train_step``'s metrics as a
    (k,) array, update i in row i (rows n.. are zeros). ``state`` is donated. ``mesh``: as in
    ``make_train_step``.

    ``fit`` runs this program (``TrainConfig.updates_per_call`` = k; one update a call is k = 1): where
    the host's cores all run the step, one dispatch, transfer and fetch per call instead of per update
    gives their time back to the step (docs/performance.md)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (updates per call) must be an int >= 1, got {k!r}")
    mesh = resolve_mesh(tc, mesh)
    train_step, shardings = _train_program(config, tc, mesh)

    def train_steps(state: TrainState, batches: dict, n):
        got = jax.tree.leaves(batches)[0].shape[0]
        if got != k:
            raise ValueError(f"make_train_steps(k={k}) got a chunk of {got} batches; build the program with k = "
                             f"the chunk length (fit: TrainConfig.updates_per_call)")
        shapes = jax.eval_shape(train_step, state, jax.tree.map(lambda a: a[0], batches))[1]
        rows = jax.tree.map(lambda m: jnp.zeros((k, *m.shape), m.dtype), shapes)  # (k,) per metric

        def body(i, carry):
            state, rows = carry
            state, metrics = train_step(state, jax.tree.map(lambda a: a[i], batches))
            return state, jax.tree.map(lambda r, m: r.at[i].set(m), rows, metrics)

        return jax.lax.fori_loop(0, n, body, (state, rows))

    if shardings:
        state_sh, metrics_sh = shardings["out_shardings"]
        shardings = dict(in_shardings=(state_sh, None, None), out_shardings=(state_sh, metrics_sh))
    return paced(Jit(train_steps, donate_argnums=0, **shardings), mesh, keep=lambda out: out[1])


def make_eval_step(config, *, checked: bool = False, mesh: Mesh | None = None, execution=None):
    """-> jitted ``eval_step(params, batch) -> {'loss_sum', 'count', 'correct'}`` (no dropout);
    batch without the micro-batch axis. Sum over batches, then divide by the count.
    ``checked``: checked mode, as in ``make_train_step``. ``mesh``: the mesh the params live on;
    when they are replicated there (a 'data'-only mesh, as ``TrainConfig.mesh='auto'`` makes), a
    batch whose rows divide is split over the devices and their sums added (``data_parallel``);
    other meshes and row counts are left to jit's propagation. Why not always leave it to jit: a
    propagated program carries the CPU attention kernel's ``custom_partitioning``, which JAX keys
    by a per-process object id, so it never loads from the compile cache. ``execution``: the model's
    Execution (``TrainConfig.execution``; None: the default)."""
    def eval_step(params, batch):
        checks.debug_check_batch(batch, config)
        return loss_terms(config, params, batch, train=False, execution=execution)

    if checked:
        return paced(checks.checked(eval_step, compiler_options=compiler_options() or None), mesh)
    whole = Jit(eval_step)
    if mesh is None:
        return whole
    if not replicated(param_shardings(config, abstract_params(config, execution), mesh)):
        return paced(whole, mesh)  # jit's propagation over several devices: collectives too
    devices = batch_devices(mesh.shape)

    def split(params, batch):
        checks.debug_check_batch(batch, config)  # the whole batch: a bad id is named as in eval_step
        return data_parallel(lambda p, b: loss_terms(config, p, b, train=False, execution=execution), mesh, micro_axis=False)(params, batch)

    split.__name__ = "eval_step_split"  # the program's name in profiles and compile logs
    eval_step_split = Jit(split)

    def step(params, batch):
        return eval_step_split(params, batch) if jax.tree.leaves(batch)[0].shape[0] % devices == 0 \
            else whole(params, batch)

    return paced(step, mesh)
