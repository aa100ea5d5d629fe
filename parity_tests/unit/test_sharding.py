"""Sharded training (jaxgpt.parallel.sharding) on simulated CPU devices, each case in a subprocess started
with XLA_FLAGS=--xla_force_host_platform_device_count=N (the device count is fixed when JAX
starts, and this pytest process has already started it). The worker, sharding_worker.py, prints
measurements; the assertions are here.

These are self-consistency checks: the reference is jaxgpt's own single-device step, whose
agreement with torch_ref is proven in test_train.py / test_decoder.py.

Tolerances: loss, updated params and optimizer moments within 1e-5 max abs of the single-device
step (the unchanged make_train_step(mesh=None)); only the order of the reductions differs
(measured: <= 1e-6). Checkpoint round trips across meshes: bit-identical.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import xla_flags
from jaxgpt.config import PRESETS
from jaxgpt.models import abstract_params
from jaxgpt.parallel.sharding import logical_axes, parse_mesh

WORKER = Path(__file__).with_name("sharding_worker.py")
TOL = 1e-5
MESHES = ("data=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "tensor=8")
CI_CASES = {"gpt": MESHES, "llama": ("data=2,fsdp=2,tensor=2", "tensor=8"),  # GQA with TP in CI
            "modern": ("data=2,fsdp=2,tensor=2",), "neox": ("data=2,fsdp=2,tensor=2",)}  # the newer layer options
SLOW_CASES = {"llama": ("data=8", "data=2,fsdp=4")}
# Expert parallelism (MoE, 8 experts): alone, with data + tensor, with FSDP; the grouped implementation too
MOE_CASES = {"moe": ("expert=8", "data=2,expert=2,tensor=2", "fsdp=2,expert=4"), "moe-grouped": ("data=2,expert=4",)}


def run_worker(*args: str, devices: int, timeout: float = 300, wait: bool = True):
    env = {**os.environ, "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}"),
           "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(WORKER), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=WORKER.parent)
    return proc if not wait else result(proc, timeout)


def result(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker {proc.args[2:]} ran past {timeout} s:\n{out[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker {proc.args[2:]} failed:\n{out[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def steps() -> dict:
    return {k: v for name, meshes in CI_CASES.items() for k, v in run_worker("steps", name, *meshes, devices=8).items()}


def _check_step(row: dict) -> None:
    assert row["init"] == 0.0, "jit(init, out_shardings=...) drew other numbers than the single-device init"
    for what in ("loss", "grad_norm", "params", "opt_state"):
        assert row[what] <= TOL, f"{what} differs from the single-device step by {row[what]:.3g}"


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
@pytest.mark.parametrize("case", [f"{n} {m}" for n, ms in CI_CASES.items() for m in ms])
def test_sharded_step_matches_single_device(steps, case):
    _check_step(steps[case])


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
def test_expert_parallel_step_matches_single_device():
    """The 'expert' axis: each device holds n_experts / expert of every MoE layer's experts (and their
    Adam moments), the batch is split over it too, and loss, params and moments equal one device's."""
    rows = {k: v for name, meshes in MOE_CASES.items() for k, v in run_worker("steps", name, *meshes, devices=8).items()}
    for case, row in rows.items():
        _check_step(row)
        e = parse_mesh(case.split()[1])["expert"]
        assert "'expert'" in row["expert_spec"], row["expert_spec"]
        assert row["expert_shard"][1] == 8 // e, f"{case}: {row['expert_shard']}"  # (L, E / expert, d, f)


@pytest.mark.slow
def test_sharded_step_llama_data_fsdp():
    for row in run_worker("steps", "llama", *SLOW_CASES["llama"], devices=8).values():
        _check_step(row)


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
@pytest.mark.parametrize("case", [f"gpt {m}" for m in MESHES] + [f"llama {m}" for m in CI_CASES["llama"]])
def test_params_and_optimizer_really_sharded(steps, case):
    row, sizes = steps[case], parse_mesh(case.split()[1])
    for what in ("param", "opt"):
        per_device, total = row[f"{what}_bytes"], row[f"total_{what}_bytes"]
        if sizes["fsdp"] == sizes["tensor"] == 1:
            assert per_device == total, f"data parallel must replicate {what}s"
        else:  # small replicated leaves (norms, some biases) keep it a little above total / fsdp
            assert per_device <= total / sizes["fsdp"] * 1.2, f"{what} bytes per device {per_device} of {total}"
            assert per_device < total


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
@pytest.mark.parametrize("case", ["gpt data=2,fsdp=4", "gpt data=2,fsdp=2,tensor=2", "llama data=2,fsdp=2,tensor=2"])
def test_fsdp_gathers_weights_per_layer_inside_the_scan(steps, case):
    # the compiled step all-gathers inside the layer loop's while body (ZeRO-3), not the whole stack up front
    assert steps[case]["gather_in_scan"]


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
def test_data_parallel_gathers_nothing(steps):
    assert not steps["gpt data=8"]["gather_in_scan"]


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
def test_gqa_kv_heads_replicated_when_tensor_exceeds_them(steps):
    # llama: 8 query heads, 2 kv heads. tensor=2 splits k_proj by kv head; tensor=8 cannot, so it stays whole
    assert steps["llama data=2,fsdp=2,tensor=2"]["k_proj_spec"] == "P(None, 'fsdp', 'tensor')"
    assert steps["llama data=2,fsdp=2,tensor=2"]["k_proj_shard"] == [2, 16, 4]
    assert steps["llama tensor=8"]["k_proj_spec"] == "P(None, 'fsdp', None)"
    assert steps["llama tensor=8"]["k_proj_shard"] == [2, 32, 8]


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
def test_checkpoint_restores_onto_other_meshes(tmp_path):
    saved = run_worker("save", str(tmp_path / "run"), "data=2,fsdp=2,tensor=2", str(tmp_path / "saved.npz"), devices=8)
    assert saved == {"devices": 8, "shards": 8}
    ref = np.load(tmp_path / "saved.npz")
    for devices, mesh in ((2, "fsdp=2"), (1, "")):
        got = run_worker("restore", str(tmp_path / "run"), mesh, str(tmp_path / f"{devices}.npz"), devices=devices)
        assert got["devices"] == devices and got["shards"] == devices and got["params_only"] == 0.0
        restored = np.load(tmp_path / f"{devices}.npz")
        assert sorted(restored.files) == sorted(ref.files)
        for k in ref.files:
            np.testing.assert_array_equal(restored[k], ref[k], err_msg=f"{k} restored on {devices} device(s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess  # sharding_worker.py subprocesses: make test-slow
def test_two_processes_on_localhost():
    port = str(_free_port())
    procs = [run_worker("dist", port, str(i), "2", "data=2,fsdp=2", devices=2, wait=False) for i in range(2)]
    try:
        a, b = (result(p, timeout=240) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert (a["processes"], a["devices"], a["local_devices"]) == (2, 4, 2) and {a["process"], b["process"]} == {0, 1}
    assert a["losses"] == b["losses"] and a["param_abs_sum"] == b["param_abs_sum"]
    ref = run_worker("serial", devices=1)
    np.testing.assert_allclose(a["losses"], ref["losses"], rtol=0, atol=TOL)
    np.testing.assert_allclose(a["param_abs_sum"], ref["param_abs_sum"], rtol=1e-6)


# -- in this process: the rules, the mesh syntax, the device set-up ------------------------------
def test_host_devices_after_jax_started_is_an_error():
    import jax

    from jaxgpt.parallel.sharding import use_host_devices

    n = jax.device_count()  # this pytest process has started JAX (import jaxgpt: one CPU device per core)
    use_host_devices(n)  # enough already: nothing to do
    with pytest.raises(ValueError, match=rf"JAX has already started with {n} device\(s\), so {n + 1} host devices"):
        use_host_devices(n + 1)


def test_multi_host_flags_go_together(monkeypatch):
    import argparse

    import jax

    joined = []  # never reach the real jax.distributed.initialize: it would wait for the other process
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: joined.append((a, k)))

    from jaxgpt.cli.common import start_devices

    args = argparse.Namespace(coordinator="127.0.0.1:1234", num_processes=None, process_id=0, mesh=None)
    with pytest.raises(ValueError, match="needs --coordinator HOST:PORT, --num-processes N and --process-id I"):
        start_devices(args)
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\), got 2"):
        start_devices(argparse.Namespace(coordinator="127.0.0.1:1234", num_processes=2, process_id=2, mesh=None))
    # each process brings mesh size / processes devices: a mesh of 3 cannot be shared by 2 processes
    with pytest.raises(ValueError, match=r"^--mesh fsdp=3 spans 3 devices, which do not split evenly over "
                       r"--num-processes 2; use a mesh whose size is a multiple of 2$"):
        start_devices(argparse.Namespace(coordinator="127.0.0.1:1234", num_processes=2, process_id=0, mesh="fsdp=3"))
    assert joined == []
    start_devices(argparse.Namespace(coordinator="127.0.0.1:1234", num_processes=2, process_id=1, mesh="fsdp=2"))
    assert joined == [(("127.0.0.1:1234",), {"num_processes": 2, "process_id": 1})]  # one host device each: fits


def test_train_config_mesh_is_validated():
    from jaxgpt.config import TrainConfig

    assert TrainConfig(mesh="data=2,fsdp=2", batch_size=8).mesh == "data=2,fsdp=2"
    with pytest.raises(ValueError, match=r"data\*fsdp\*expert=4 devices, but batch_size/grad_accum=6 is not a multiple"):
        TrainConfig(mesh="data=2,fsdp=2", batch_size=6)
    with pytest.raises(ValueError, match="bad mesh 'gpu=2'"):
        TrainConfig(mesh="gpu=2")
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parameter_has_a_rule(name):
    import jax

    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(PRESETS[name])):
        axes = logical_axes(path, leaf.ndim)  # raises on a parameter no rule covers
        assert len(axes) == leaf.ndim


def _abstract_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1):
    """A mesh of any size without the devices (param_specs reads only its axis sizes)."""
    from jax.sharding import AbstractMesh

    return AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


def _replicated_over(specs, params, axis: str) -> int:
    """Parameters whose PartitionSpec does not name ``axis``, counted from the specs themselves."""
    import jax
    from jax.sharding import PartitionSpec as P

    named = lambda s: {a for e in s for a in ((e,) if isinstance(e, str) else e or ())}
    return sum(int(np.prod(x.shape)) for x, s in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P)))
               if axis not in named(s))


def test_a_mesh_that_cannot_split_a_parameter_says_which_and_how_much_stays_whole():
    """gpt2-small on fsdp=4,tensor=2 (issue #18): vocab 50257 is odd, so the tied embedding cannot be
    split over 'tensor'; with the position table, norms and d_model biases (replicated over
    'tensor' by design) 31.7% of the parameters stay whole on both tensor devices."""
    from jaxgpt.parallel.sharding import ReplicationWarning, param_specs

    config, mesh = PRESETS["gpt2-small"], _abstract_mesh(fsdp=4, tensor=2)
    params = abstract_params(config)
    with pytest.warns(ReplicationWarning) as caught:
        specs = param_specs(config, params, mesh)
    (message,) = [str(w.message) for w in caught if w.category is ReplicationWarning]
    assert message == (
        "mesh fsdp=4,tensor=2 cannot split 1 parameter as the sharding rules say, so it stays whole (replicated) "
        "over tensor: tok_embed/embedding (50257, 768): its vocab dimension 50257 is not a multiple of tensor=2. "
        "Parameters left whole over each axis: fsdp 0.1% (102,912 of 124,439,808), tensor 31.7% (39,440,640 of "
        "124,439,808; 31.0% from the parameters above). Training is still correct, but each device holds more "
        "than the mesh suggests; to split them: vocab_size=50258 (a multiple of tensor=2); or a smaller axis")
    # the counts are the specs' own: what param_specs returned leaves exactly these out
    assert _replicated_over(specs, params, "tensor") == 39_440_640
    assert _replicated_over(specs, params, "fsdp") == 102_912
    assert tuple(specs["tok_embed"]["embedding"]) == (None, "fsdp")


def test_head_counts_that_do_not_divide_are_named_and_a_mesh_that_fits_is_quiet():
    import warnings

    from jaxgpt.parallel.sharding import ReplicationWarning, param_specs, unsplit

    config = PRESETS["llama-small"]  # 12 query heads, 4 kv heads
    report = unsplit(config, abstract_params(config), _abstract_mesh(tensor=8))
    reasons = {f["param"]: f["reason"] for f in report["failed"]}
    assert reasons == {"layers/attn/q_proj/kernel": "n_head=12 is not a multiple of tensor=8 (a head would be cut)",
                       "layers/attn/o_proj/kernel": "n_head=12 is not a multiple of tensor=8 (a head would be cut)",
                       "layers/attn/k_proj/kernel": "n_kv_head=4 is not a multiple of tensor=8 (a head would be cut)",
                       "layers/attn/v_proj/kernel": "n_kv_head=4 is not a multiple of tensor=8 (a head would be cut)"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)  # a warning here fails the test
        for name, mesh in (("llama-small", _abstract_mesh(fsdp=2, tensor=4)), ("gpt2-small", _abstract_mesh(fsdp=8)),
                           ("bert-base", _abstract_mesh(fsdp=4, tensor=2))):
            param_specs(PRESETS[name], abstract_params(PRESETS[name]), mesh)
        padded = PRESETS["gpt2-small"].replace(vocab_size=50304)  # the suggested fix silences it
        param_specs(padded, abstract_params(padded), _abstract_mesh(fsdp=4, tensor=2))


def test_unknown_parameter_is_an_error():
    import jax

    with pytest.raises(ValueError, match=r"no sharding rule for parameter 'layers/attn/gate_x/kernel'"):
        logical_axes((jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("attn"),
                      jax.tree_util.DictKey("gate_x"), jax.tree_util.DictKey("kernel")), 2)


def test_parse_mesh():
    assert parse_mesh("data=8") == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert parse_mesh("tensor=8", 8) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 8}
    assert parse_mesh("data=2, fsdp=2,tensor=2", 8) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert parse_mesh("data=2,expert=4", 8) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    with pytest.raises(ValueError, match=r"mesh 'data=2,fsdp=2' needs 4 devices .* but 8 are available"):
        parse_mesh("data=2,fsdp=2", 8)
    for bad in ("data", "pipeline=2", "data=0", "data=2,data=2", "data=x", ""):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh(bad)



@pytest.mark.slow  # a checkified sharded step compiles for ~13 s: make test-slow
def test_checked_step_on_the_host_mesh():
    """mesh=... with checked=True (a mesh over this process's devices: one per core): same loss as the
    plain step, and a bad target still raises instead of being scored as the last class."""
    import jax

    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.parallel.sharding import make_mesh, shard_batch
    from jaxgpt.train.step import init_state, make_train_step

    cfg = ModelConfig(vocab_size=16, d_model=16, n_layer=1, n_head=2, max_len=8)
    spec = f"data={jax.device_count()}"
    tc, mesh = TrainConfig(steps=2, batch_size=2, seq_len=4, mesh=spec), make_mesh(spec)
    x = np.arange(8, dtype=np.int32).reshape(1, 2, 4)  # (A, B, T)
    good, bad = {"x": x, "y": x + 1}, {"x": x, "y": x.copy()}
    bad["y"][0, 1, 2] = 16
    _, ref = make_train_step(cfg, tc)(init_state(cfg, tc), good)
    strict = make_train_step(cfg, tc, mesh=mesh, checked=True)
    _, m = strict(init_state(cfg, tc, mesh=mesh), shard_batch(good, mesh))
    assert abs(float(m["loss"]) - float(ref["loss"])) <= TOL
    with pytest.raises(ValueError, match=r"target 16 is outside \[0, 16\)"):
        strict(init_state(cfg, tc, mesh=mesh), shard_batch(bad, mesh))
