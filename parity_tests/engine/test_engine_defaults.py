"""The engine's 'auto' defaults (issue #19): what a user gets without flags is the fast path, with
the same numbers.

- ``scan_unroll='auto'``: every layer in one scan iteration on the CPU and GPU, rolled elsewhere.
- ``import jaxgpt`` (and ``jaxgpt.models``) changes no environment variable; ``jaxgpt.use_host_devices()``
  (called by the ``jaxgpt`` command and ``fit``) asks XLA for one CPU device per core, up to
  ``host_devices.AUTO_MAX``, unless the user chose (``JAXGPT_HOST_DEVICES``, ``XLA_FLAGS``); checked in fresh
  interpreters.
- ``TrainConfig.mesh='auto'``: the train step splits the batch over those devices. Self-consistency
  against the single-device step (mesh=None) at 1e-6; the step against torch_ref is test_train.py's.
  With replicated params and no dropout the gradient is ``parallel.data_parallel``'s shard_map, whose
  only f32 collective is one all-reduce of one buffer (counted in the compiled HLO).
- exact GELU written with erf: checked against torch's nn.GELU() in test_mlp.py; here against the
  erfc form JAX uses (self-consistency, 1e-6).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ACCELERATOR_SKIP
from jaxgpt.config import Execution, ModelConfig, TrainConfig
from jaxgpt.nn.kernels.exec_policy import scan_unroll
from jaxgpt.models import build
from jaxgpt.nn.mlp import gelu
from jaxgpt.parallel import host_devices
from jaxgpt.train.step import init_state, make_train_step

SELF_TOL = 1e-6
CFG = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, max_len=16)


def test_scan_unroll_auto_unrolls_on_cpu_and_gpu():
    assert Execution().scan_unroll == "auto"
    assert scan_unroll(Execution(), CFG.n_layer) == (CFG.n_layer if jax.default_backend() in ("cpu", "gpu") else 1)
    assert scan_unroll(Execution(scan_unroll=1), CFG.n_layer) == 1
    with pytest.raises(ValueError, match="scan_unroll must be a positive int, got 'fast'"):
        Execution(scan_unroll="fast")


def _fresh_interpreter(code: str, env: dict) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", host_devices.ENV)} | env
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          check=True).stdout.split()[-1]


def _devices_in_fresh_interpreter(env: dict, setup: str = "jaxgpt.use_host_devices()") -> int:
    return int(_fresh_interpreter(f"import jaxgpt, jax; {setup}; print(jax.device_count())", env))


def test_use_host_devices_asks_for_one_cpu_device_per_core():
    cores = len(os.sched_getaffinity(0))
    assert _devices_in_fresh_interpreter({}) == min(cores, host_devices.AUTO_MAX)
    assert _devices_in_fresh_interpreter({host_devices.ENV: "1"}) == 1
    # the user's own flag wins, whatever JAXGPT_HOST_DEVICES says
    assert _devices_in_fresh_interpreter({"XLA_FLAGS": "--xla_force_host_platform_device_count=3",
                                          host_devices.ENV: "2"}) == 3
    assert _devices_in_fresh_interpreter({}, setup="jaxgpt.use_host_devices(3)") == 3
    # once JAX has started, 'auto' leaves it be, and an explicit count it cannot give is an error
    assert _devices_in_fresh_interpreter({}, setup="jax.devices(); jaxgpt.use_host_devices()") == 1
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero"):
        _devices_in_fresh_interpreter({}, setup="jax.devices(); jaxgpt.use_host_devices(2)")


def test_import_changes_no_environment_variable():
    # jax sets two variables of its own on import, so the baseline is taken after importing it
    code = ("import os, jax; before = dict(os.environ); import jaxgpt, jaxgpt.models, jaxgpt.train, "
            "jaxgpt.inference.generate; print(dict(os.environ) == before and jax.device_count() == 1)")
    assert _fresh_interpreter(code, {}) == "True"


def test_fit_splits_the_cpu_before_jax_starts(tmp_path):
    code = ("import jaxgpt, jax; from jaxgpt.train.loop import fit; "
            "from jaxgpt.data.tasks import fit_config, load_task; from jaxgpt.config import TrainConfig, get_preset; "
            "tc = TrainConfig(steps=1, batch_size=2, seq_len=8); "
            "task = load_task(get_preset('seed-minigpt'), tc, corpus='seed-synthetic'); "
            "cfg = fit_config(get_preset('seed-minigpt').replace(max_len=8, n_layer=1), task); "
            "fit(cfg, tc, task, checkpoints=False, progress=False, log=lambda *a: None); print(jax.device_count())")
    cores = len(os.sched_getaffinity(0))
    assert int(_fresh_interpreter(code, {})) == min(cores, host_devices.AUTO_MAX)


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_host_devices_env_is_validated(bad, monkeypatch):
    monkeypatch.setenv(host_devices.ENV, bad)
    with pytest.raises(ValueError, match=f"JAXGPT_HOST_DEVICES='{bad}': expected 'auto' or a device count >= 1"):
        host_devices.requested()


def _batch(rows: int, seed: int = 0) -> dict:
    w = np.random.default_rng(seed).integers(0, CFG.vocab_size, (1, rows, 9)).astype(np.int32)
    return {"x": w[:, :, :-1], "y": w[:, :, 1:]}


# rows 4: data_parallel's shard_map; 3 rows (a batch unlike tc's) do not split: run whole on each device;
# dropout: GSPMD's step (masks drawn for the global batch); grad_accum 2: the micro-batch scan inside shard_map
@pytest.mark.parametrize("rows,dropout,accum", [(4, 0.0, 1), (3, 0.0, 1), (4, 0.0, 2),
                                               pytest.param(4, 0.1, 1, marks=pytest.mark.slow)])  # ~9 s cold
def test_auto_mesh_step_equals_single_device_step(rows, dropout, accum):
    if jax.device_count() < 2:
        pytest.skip("one CPU device: the auto mesh is the single-device step")
    cfg = CFG.replace(dropout=dropout)
    tc = TrainConfig(batch_size=4 * accum, seq_len=8, steps=3, warmup_steps=1, grad_accum=accum)
    auto, single = init_state(cfg, tc), init_state(cfg, tc, mesh=None)
    assert len(auto.params["tok_embed"]["embedding"].sharding.device_set) == 2
    step_auto, step_single = make_train_step(cfg, tc), make_train_step(cfg, tc, mesh=None)
    for i in range(2):
        b = {k: np.concatenate([v] * accum) for k, v in _batch(rows, i).items()}  # (accum, rows, T)
        auto, m_auto = step_auto(auto, b)
        single, m_single = step_single(single, b)
        assert abs(float(m_auto["loss"]) - float(m_single["loss"])) < SELF_TOL
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), auto.params, single.params)
    assert max(jax.tree.leaves(diff)) < SELF_TOL


# rows 4: split over the devices (data_parallel's shard_map, micro_axis=False); 3 rows: whole on each
@pytest.mark.parametrize("rows", [4, 3])
def test_auto_mesh_eval_step_equals_single_device_eval(rows):
    """Self-consistency: the eval step on the params' auto mesh against the one-device eval step."""
    if jax.device_count() < 2:
        pytest.skip("one CPU device: the auto mesh is the single-device step")
    from jaxgpt.parallel.sharding import shard_batch
    from jaxgpt.train.mesh import resolve_mesh
    from jaxgpt.train.step import make_eval_step

    tc = TrainConfig(batch_size=4, seq_len=8, steps=3)
    mesh = resolve_mesh(tc)
    params = init_state(CFG, tc).params  # replicated over the mesh
    batch = {k: v[0] for k, v in _batch(rows, 1).items()}  # (rows, T): no micro-batch axis
    on_mesh = make_eval_step(CFG, mesh=mesh)
    placed = shard_batch(batch, mesh, lead=0) if rows % 2 == 0 else batch
    got, want = on_mesh(params, placed), make_eval_step(CFG)(init_state(CFG, tc, mesh=None).params, batch)
    for k in ("loss_sum", "count", "correct"):
        assert abs(float(got[k]) - float(want[k])) < SELF_TOL * max(1.0, abs(float(want[k]))), k
    if rows % 2 == 0:  # split by row: one all-reduce of the three sums, and no custom_partitioning
        # callback (JAX keys one by a per-process id: such a program never loads from the compile cache)
        lowered = jax.jit(on_mesh).lower(params, placed)  # traced inside jit: Paced keeps no tracer
        assert all(not isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(list(on_mesh._pending)))
        assert "CustomSPMDPartitioning" not in lowered.as_text()
        assert _all_reduces(lowered.compile().as_text()) == ["f32[3]{0}"]


def test_auto_mesh_steps_keep_few_calls_in_flight():
    """The 2-device train step waits for the step 4 calls back before dispatching (train.compiled.Paced):
    a loop that never reads a result had let XLA:CPU fill one device's in-flight slots with later
    steps, and the all-reduce of the step the other device ran aborted the process (CI, 2026-11-25).
    Self-consistency: 12 unread steps give the losses of 12 steps read one by one."""
    if jax.device_count() < 2:
        pytest.skip("one CPU device: no collectives")
    from jaxgpt.train.compiled import Paced

    tc = TrainConfig(batch_size=4, seq_len=8, steps=12, warmup_steps=1)
    step = make_train_step(CFG, tc)
    assert isinstance(step, Paced) and step.lower  # .lower and the rest are the jitted step's
    state, metrics = init_state(CFG, tc), []
    for i in range(12):
        state, m = step(state, _batch(4, i))
        metrics.append(m)
        assert len(step._pending) <= 4
        assert all(x.is_ready() for x in jax.tree.leaves(metrics[:-4]))  # waited for before this dispatch
    ref, read = init_state(CFG, tc), []
    for i in range(12):
        ref, m = step(ref, _batch(4, i))
        read.append(float(m["loss"]))
    assert [float(m["loss"]) for m in metrics] == read
    assert make_train_step(CFG, tc, mesh=None).__class__ is not Paced  # one device: no collectives to pace


def _all_reduces(hlo: str) -> list[str]:
    return [line.split(" all-reduce(")[0].split(" = ")[1] for line in hlo.splitlines() if " all-reduce(" in line]


def test_data_parallel_step_reduces_the_gradient_as_one_buffer():
    if jax.device_count() < 2:
        pytest.skip("one CPU device: no collectives")
    tc = TrainConfig(batch_size=4, seq_len=8, steps=3, warmup_steps=1)
    n_params = sum(x.size for x in jax.tree.leaves(init_state(CFG, tc, mesh=None).params))
    hlo = make_train_step(CFG, tc).lower(init_state(CFG, tc), _batch(4)).compile().as_text()
    # one f32 buffer: every gradient, the loss sum, and the target and correct counts (exact in float32)
    # (GSPMD's step, taken with dropout, reduces one buffer per parameter: the per-buffer cost removed)
    assert _all_reduces(hlo) == [f"f32[{n_params + 3}]{{0}}"]
    # ...so the devices meet once: no backward op is scheduled after it (a separate s32 all-reduce of
    # the counts ran in the middle of the forward)
    entry = hlo[hlo.index("\nENTRY "):].splitlines()
    first = next(i for i, line in enumerate(entry) if " all-reduce(" in line)
    assert not [line for line in entry[first:] if "transpose(jvp(" in line]


def test_psum_flat_equals_psum():
    if jax.device_count() < 2:
        pytest.skip("one CPU device")
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxgpt.parallel.data_parallel import psum_flat

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    tree = {"a": jnp.arange(12.0).reshape(2, 2, 3), "b": jnp.arange(4, dtype=jnp.int32).reshape(2, 2),
            "c": jnp.ones((2, 5), jnp.bfloat16)}
    run = lambda f: jax.jit(jax.shard_map(lambda t: f(jax.tree.map(lambda x: x[0], t), "d"), mesh=mesh,
                                          in_specs=P("d"), out_specs=P()))(tree)
    want = run(jax.lax.psum)
    # int_bound: the integers travel as float32 below 2^24 (one all-reduce fewer), on their own above
    for bound, n_psums in ((None, 3), (2 ** 24 - 1, 2), (2 ** 24, 3)):
        f = functools.partial(psum_flat, int_bound=bound)
        got = run(f)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(lambda x: (x.shape, x.dtype), want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        jaxpr = str(jax.make_jaxpr(lambda t: jax.shard_map(lambda u: f(u, "d"), mesh=mesh, in_specs=P("d"),  # noqa: B023 - called in this iteration
                                                            out_specs=P())(t))(tree))
        assert jaxpr.count("psum") == n_psums, (bound, jaxpr.count("psum"))


def test_auto_mesh_off_where_it_cannot_help():
    from jaxgpt.parallel.sharding import auto_mesh
    from jaxgpt.train.mesh import resolve_mesh

    assert resolve_mesh(TrainConfig(mesh=""), "auto") is None
    assert resolve_mesh(TrainConfig(), None) is None
    if jax.device_count() >= 2:
        assert auto_mesh(3) is None  # no divisor of 3 rows up to 2 devices but 1
        assert auto_mesh(4).shape["data"] == 2
    with pytest.raises(ValueError, match="mesh='data=2': pass a Mesh, None"):
        resolve_mesh(TrainConfig(), "data=2")


def test_gelu_erf_form_equals_jax_exact_gelu():
    x = jnp.linspace(-12.0, 12.0, 10001, dtype=jnp.float32)
    assert float(jnp.max(jnp.abs(gelu(x) - jax.nn.gelu(x, approximate=False)))) < SELF_TOL
    g = jax.vmap(jax.grad(gelu))(x)
    g_ref = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(x)
    assert float(jnp.max(jnp.abs(g - g_ref))) < SELF_TOL


def test_attention_impl_auto_picks_by_backend_and_shape():
    from jaxgpt.nn.kernels import auto_impl

    assert Execution().attention_impl == "auto"
    cpu = jax.default_backend() == "cpu"
    assert auto_impl(256, 256, 128) == ("blocked" if cpu else "xla")  # training / prefill over 2 key blocks
    assert auto_impl(64, 64, 128) == "xla"  # one key block: nothing to skip
    assert auto_impl(1, 1024, 128) == "xla"  # a decode step
    assert auto_impl(256, 256, 128, dropout_rate=0.1) == "xla"  # the only kernel with attention dropout
    # so 'auto' accepts attention dropout, where an explicit kernel without it is refused
    build(ModelConfig(attn_dropout=0.1))
    with pytest.raises(ValueError, match="attention_impl='blocked' has no attention dropout"):
        build(ModelConfig(attn_dropout=0.1), Execution(attention_impl="blocked"))


# --- several updates per call (TrainConfig.steps_per_call, train.step.make_train_steps) ------------------

@pytest.mark.same_bits
@pytest.mark.parametrize("mesh", ["auto", None])
def test_train_steps_give_the_updates_of_one_step_calls(mesh):
    """Self-consistency, bit for bit: 3 updates from a chunk of k=4 batches in one call (its 4th slot
    holds a batch that must not be used) against 3 calls of the one-update step on the same batches;
    on the auto mesh (2 host devices, data_parallel's shard_map inside the loop) and on one device."""
    from jaxgpt.train.step import make_train_steps

    tc = TrainConfig(batch_size=4, seq_len=8, steps=6, warmup_steps=1)
    batches = [_batch(4, i) for i in range(4)]
    chunk = {k: np.stack([b[k] for b in batches]) for k in ("x", "y")}  # (4, 1, 4, 8)
    state, metrics = make_train_steps(CFG, tc, 4, mesh=mesh)(init_state(CFG, tc, mesh=mesh), chunk, 3)
    ref, step, want = init_state(CFG, tc, mesh=mesh), make_train_step(CFG, tc, mesh=mesh), []
    for b in batches[:3]:
        ref, m = step(ref, b)
        want.append(jax.device_get(m))
    got = jax.device_get(metrics)
    assert int(state.step) == 3 and set(got) == set(want[0])
    for key in got:
        assert got[key].shape == (4,) and list(got[key][:3]) == [w[key] for w in want], key
        assert got[key][3] == 0, key  # the slot after the last update: never run
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), state, ref)
    assert all(jax.tree.leaves(same))


def test_fit_resolves_the_mesh_once_and_trains_and_evaluates_on_it(monkeypatch):
    """TrainConfig.mesh becomes devices once a run (train.mesh.resolve_mesh, called by the plan): the state's
    init, the train program and the eval step all get that one mesh, not a decision of their own."""
    from jaxgpt.train import loop, mesh, plan
    from jaxgpt.data.tasks import fit_config, load_task

    resolved, given = [], {}
    real_mesh, real_eval, real_steps = mesh.auto_mesh, plan.make_eval_step, plan.make_train_steps
    monkeypatch.setattr(mesh, "auto_mesh", lambda *a, **kw: resolved.append(real_mesh(*a, **kw)) or resolved[-1])
    monkeypatch.setattr(plan, "make_eval_step", lambda c, **kw: given.setdefault("eval", kw["mesh"]) and None
                        or real_eval(c, **kw))
    monkeypatch.setattr(plan, "make_train_steps", lambda *a, **kw: given.setdefault("train", kw["mesh"]) and None
                        or real_steps(*a, **kw))
    config = ModelConfig(d_model=32, n_layer=1, n_head=4, max_len=16)
    tc = TrainConfig(steps=4, batch_size=4, seq_len=8, log_every=2, eval_every=4, eval_batches=1, warmup_steps=1)
    task = load_task(config, tc, corpus="seed-synthetic")
    out = loop.fit(fit_config(config, task), tc, task, progress=False, checkpoints=False)
    assert len(resolved) == 1, f"the mesh was decided {len(resolved)} times"
    assert given["train"] is resolved[0] and given["eval"] is resolved[0]
    assert out["val_loss"] is not None


@pytest.mark.same_bits
def test_fit_runs_several_updates_per_call_with_the_numbers_of_one():
    """fit's calls end where it logs, evaluates or saves, the first update alone (it is timed as the
    compile); steps_per_call=1 dispatches every update by itself. Self-consistency: the same history."""
    from jaxgpt.train import loop, plan
    from jaxgpt.data.tasks import fit_config, load_task

    calls = []
    real = plan.make_train_steps

    def spy(*args, **kw):
        fn = real(*args, **kw)
        return lambda state, batches, n: calls.append(n) or fn(state, batches, n)

    config = ModelConfig(d_model=32, n_layer=2, n_head=4, max_len=16)
    tc = TrainConfig(steps=13, batch_size=4, seq_len=8, log_every=4, eval_every=6, eval_batches=1, warmup_steps=1)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "make_train_steps", spy)
        many = loop.fit(config, tc, task, progress=False, checkpoints=False)
    # updates 1 | 2-4 (log) | 5-6 (eval) | 7-8 (log) | 9-12 (log, eval) | 13 (the end)
    assert calls == [1, 3, 2, 2, 4, 1]
    one = loop.fit(config, tc.replace(steps_per_call=1), task, progress=False, checkpoints=False)
    strip = lambda h: [{k: v for k, v in r.items() if k != "tok_s"} for r in h]
    assert strip(many["history"]) == strip(one["history"]) and len(many["history"]) == 13 + 3


@pytest.mark.parametrize("bad,why", [(0, "'auto' or an int >= 1"), (-2, "'auto' or an int >= 1"),
                                     ("fast", "'auto' or an int >= 1"), (True, "an int or a str"),
                                     (1.5, "an int or a str")])
def test_steps_per_call_is_validated(bad, why):
    with pytest.raises((TypeError, ValueError), match=f"steps_per_call must be {why}, got {bad!r}"):
        TrainConfig(steps_per_call=bad)
    assert TrainConfig(log_every=10).updates_per_call == 10
    assert TrainConfig(log_every=1000).updates_per_call == 64 and TrainConfig(steps_per_call=3).updates_per_call == 3


def _ynn_dots(hlo: str) -> int:
    """YNNPACK fusions of a compiled program that hold a dot."""
    import re

    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
        elif name:
            bodies.setdefault(name, []).append(line)
    calls = [m.group(1) for line in hlo.splitlines() if "__ynn_fusion" in line or "ynn_fusion" in line.split("=")[0]
             for m in [re.search(r"calls=%([\w.\-]+)", line)] if m]
    return sum(any(" dot(" in b for b in bodies.get(c, [])) for c in calls)


def test_cpu_steps_leave_dots_to_eigen(monkeypatch):
    """train.compiled.CPU_OPTIONS reach the compiled steps: no YNNPACK fusion holds a dot (XLA's default
    gives YNNPACK every dot); a jaxlib that does not know the option compiles with its defaults."""
    from jaxgpt.train import compiled

    if jax.default_backend() != "cpu":
        pytest.skip(f"{ACCELERATOR_SKIP} a CPU compiler option (this backend: {jax.default_backend()})")
    tc = TrainConfig(batch_size=4, seq_len=8, steps=3, warmup_steps=1)
    state, batch = init_state(CFG, tc, mesh=None), _batch(4)
    assert compiled.compiler_options() == compiled.CPU_OPTIONS
    ours = make_train_step(CFG, tc, mesh=None).lower(state, batch).compile().as_text()
    xla = jax.jit(lambda s, b: make_train_step(CFG, tc, mesh=None)(s, b)).lower(state, batch).compile().as_text()
    assert _ynn_dots(ours) == 0 and _ynn_dots(xla) > 0
    monkeypatch.setattr(compiled, "CPU_OPTIONS", {"xla_cpu_experimental_ynn_fusion_type": "NO_SUCH_TYPE"})
    compiled.compiler_options.cache_clear()
    try:
        assert compiled.compiler_options() == {}
    finally:
        compiled.compiler_options.cache_clear()
