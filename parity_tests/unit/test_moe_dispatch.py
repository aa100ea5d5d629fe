"""MoE expert-parallel dispatch and capacity factor (jaxgpt/nn/moe_dispatch.py, MoEConfig.impl='alltoall').

Bottom-up: the capacity and priority rule against hand-worked slots (and torch_ref's loop), the
'alltoall' layer against torch_ref (forward, every gradient and the dropped-pair count) dropless and
with a factor that drops, the train step's expert_dropped metric against torch_ref's, the errors, and (8 simulated
CPU devices, a subprocess) the expert-parallel train step on data=2,expert=4: all-to-alls in its
compiled HLO, loss / grad norm / updated params within 1e-5 of the one-device dense step when nothing is
dropped, dropped pairs reported when the factor is small (and fsdp=2,expert=2,tensor=2, dropless).

Tolerances: float32 1e-5, as everywhere. Router inputs have a gap > 1e-4 between the k-th and (k+1)-th
logit (asserted), so no top-k choice is a tie."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from conftest import assert_close, check_module, random_params, randomize, xla_flags
from jaxgpt.config import ModelConfig, MoEConfig, TrainConfig
from jaxgpt.nn.moe import MoE
from jaxgpt.nn.moe_dispatch import capacity, slots
from jaxgpt.train import init_state, make_train_step
from torch_ref.convert import load_params
from torch_ref.nn.moe import MoE as TMoE
from torch_ref.train import make_optimizer, train_step as torch_train_step

BASE = dict(vocab_size=40, d_model=16, n_head=2, n_layer=2, max_len=32, pos="rope", d_ff=24)
# a shared expert and unrenormalised weights (Qwen2-MoE), the 'alltoall' impl
QWEN = ModelConfig(**BASE, moe=MoEConfig(n_experts=4, top_k=2, d_ff=12, norm_topk=False, shared_d_ff=20,
                                         impl="alltoall"))
WORKER = Path(__file__).with_name("moe_dispatch_worker.py")
TOL = 1e-5


def assert_no_ties(logits, k):
    z = -np.sort(-np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1]), axis=-1)
    assert (z[:, k - 1] - z[:, k]).min() > 1e-4, "a near-tie in the router's top-k: pick other weights"


def test_capacity_and_priority_rule():
    """ceil(f * tokens * k / E), at most the group's tokens; slots per expert: every first choice before
    any second choice, then token order. Expected slots worked by hand."""
    assert capacity(8, 2, 8, None) == 8 and capacity(8, 2, 8, 100.0) == 8  # dropless / never more than the tokens
    assert capacity(8, 2, 8, 0.5) == 1 and capacity(7, 1, 4, 1.0) == 2 and capacity(10, 2, 4, 1.0) == 5
    idx = np.array([[0, 1], [0, 2], [1, 0], [0, 1]])  # (N=4, k=2) over E=3, capacity 2
    # rank 0: expert 0 gets tokens 0, 1, 3 (slots 0 1 2), expert 1 token 2; rank 1: expert 1 gets tokens 0, 3
    # after token 2 (slots 1 2), expert 2 token 1 (slot 0), expert 0 token 2 after three first choices (slot 3)
    want_pos = [[0, 1], [1, 0], [0, 3], [2, 2]]
    want_keep = [[True, True], [True, True], [True, False], [False, False]]
    pos, keep = slots(jnp.asarray(idx), 3, 2)
    assert np.asarray(pos).tolist() == want_pos and np.asarray(keep).tolist() == want_keep
    tm = TMoE(ModelConfig(**BASE, moe=MoEConfig(n_experts=3, top_k=2, d_ff=12, impl="alltoall",
                                                capacity_factor=1.0)))  # C = ceil(1.0 * 4 * 2 / 3) = 3
    tm.capacity_factor = 0.75  # C = ceil(0.75 * 4 * 2 / 3) = 2, as above
    assert tm.kept(torch.from_numpy(idx)).tolist() == want_keep
    # capacity 1: token 1's first choice (expert 1) outranks token 0's second (expert 1 too), which
    # token order alone would have kept
    idx = np.array([[0, 1], [1, 2]])
    pos, keep = slots(jnp.asarray(idx), 3, 1)
    assert np.asarray(pos).tolist() == [[0, 1], [0, 0]] and np.asarray(keep).tolist() == [[True, False], [True, True]]
    tm.capacity_factor = 0.75  # C = ceil(0.75 * 2 * 2 / 3) = 1
    assert tm.kept(torch.from_numpy(idx)).tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize("cf", [None, 0.5], ids=["dropless", "cf0.5"])
def test_alltoall_layer_matches_torch_ref(cf):
    """The layer (one group: no mesh) against torch_ref's loop: forward, every gradient, and the count of
    dropped (token, expert) pairs. cf=0.5 keeps 4 of the 7 pairs each expert could get: the drop rule
    itself is cross-checked (the kept pairs and the zero weight of the others)."""
    cfg = QWEN.replace(moe=QWEN.moe.replace(capacity_factor=cf))
    x = np.random.default_rng(2).standard_normal((2, 7, 16)).astype(np.float32)
    p = random_params(MoE(cfg), x, seed=2)
    assert_no_ties(x @ np.asarray(p["router"]["kernel"]), 2)
    tm = TMoE(cfg)
    check_module(f"MoE layer (alltoall, capacity_factor={cf})", MoE(cfg), tm, [x], params=p)
    _, state = MoE(cfg).apply({"params": p}, x, mutable=["router"])
    dropped = float(state["router"]["stats"][0]["dropped"])
    assert dropped == tm.stats["dropped"], (dropped, tm.stats["dropped"])
    assert (dropped > 0) == (cf is not None), dropped  # 14 tokens x 2 picks over 4 experts of 4 slots each


def test_train_step_reports_expert_dropped_as_torch_ref():
    """One update with a factor that drops (1.0: 8 slots per expert for a layer's 32 picks; 1/8 dropped) and
    dropless: metrics['expert_dropped'] (the dropped pairs' share of all layers' top-k pairs), loss and
    grad norm against torch_ref's train_step on the same unit-scale weights and batch."""
    tc = TrainConfig(steps=2, batch_size=2, seq_len=8, mesh="")
    tokens = np.random.default_rng(0).integers(0, 40, (1, 2, 9)).astype(np.int32)
    batch = {"x": tokens[..., :-1], "y": tokens[..., 1:]}
    seen = {}
    for cf in (None, 1.0):
        cfg = QWEN.replace(moe=QWEN.moe.replace(capacity_factor=cf))
        state = init_state(cfg, tc)
        state = state.replace(params=randomize(state.params, 7))
        model = load_params(torch_ref.build(cfg), jax.device_get(state.params))
        ref = torch_train_step(model, *make_optimizer(model, tc), tc, batch)
        _, m = make_train_step(cfg, tc)(state, batch)
        seen[cf] = float(m["expert_dropped"])
        for what in ("expert_dropped", "loss", "grad_norm"):
            assert_close(float(m[what]), ref[what], f"train step {what} (capacity_factor={cf}) vs torch_ref")
    assert seen[None] == 0.0 and seen[1.0] > 0.0, seen


@pytest.mark.parametrize("moe,message", [
    (dict(capacity_factor=1.0), "moe.capacity_factor=1.0 needs moe.impl='alltoall'"),
    (dict(impl="grouped", capacity_factor=2.0), "got impl='grouped'"),
    (dict(impl="alltoall", capacity_factor=0.0), "moe.capacity_factor must be None .* > 0, got 0.0"),
    (dict(impl="alltoall", capacity_factor=-1), "got -1.0"),
    (dict(impl="alltoall", capacity_factor=float("inf")), "capacity_factor must be a finite number"),
], ids=["dense", "grouped", "zero", "negative", "inf"])
def test_capacity_factor_errors_name_the_value(moe, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**moe)


@pytest.mark.parametrize("sizes,message", [
    ((1, 1, 3, 1), "n_experts=4 is not a multiple of expert=3"),
    ((2, 1, 2, 1), "6 tokens do not split over data\\*fsdp\\*expert=4 devices"),
], ids=["experts", "tokens"])
def test_expert_mesh_that_does_not_divide_is_named(sizes, message):
    """Under an (abstract, device-free) expert mesh, shapes that cannot be split are errors at trace time."""
    from jax.sharding import AbstractMesh

    from jaxgpt.nn.moe_dispatch import experts_alltoall

    z = jnp.zeros
    with jax.sharding.use_abstract_mesh(AbstractMesh(sizes, ("data", "fsdp", "expert", "tensor"))):
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(lambda: experts_alltoall(z((6, 4)), z((4, 4, 2)), z((4, 4, 2)), z((4, 2, 4)), z((6, 2)),
                                                    z((6, 2), jnp.int32)))


CASES = ("data=2,expert=4/none", "data=2,expert=4/3", "data=2,expert=4/0.5", "fsdp=2,expert=2,tensor=2/none")


@pytest.mark.multiprocess  # an 8-device subprocess (30-100 s on 2 cores): make test-slow
def test_expert_parallel_dispatch_on_eight_devices():
    """data=2,expert=4: one token group per device, two all-to-alls per MoE layer and direction in the
    compiled train step (rolled layer scan: the forward's and the backward's bodies hold 2 each). Dropless,
    and with capacity factor 3 (6 slots of 8 tokens per group; nothing drops on this batch, asserted),
    loss, grad norm and updated params equal the one-device step of the dense impl within 1e-5; with 0.5
    (1 slot) pairs are dropped, reported as expert_dropped, and the loss moves. With either factor,
    expert_dropped, the loss and the grad norm equal torch_ref's train step with its capacity rule run on
    each device's group of 8 tokens (the worker's reference) within 1e-5. fsdp=2,expert=2,tensor=2,
    dropless: the experts' fsdp and tensor splits gathered at the dispatch's boundary, the same numbers."""
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu",
           # the worktree's jaxgpt, not an installed copy
           "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKER.parents[2]), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(WORKER), *CASES], env=env, capture_output=True, text=True,
                          timeout=600, cwd=WORKER.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
    rows = json.loads(lines[-1][len("RESULT "):])
    for case, row in rows.items():
        assert row["all_to_all"] >= 4, f"{case}: {row['all_to_all']} all-to-alls in the HLO"
    for case in CASES:
        if "torch_loss" in rows[case]:  # a capacity factor: torch_ref's rule applied to each device's group
            row = rows[case]
            assert row["groups"] == 8 and max(row["torch_dropped_diff"], row["torch_loss"], row["torch_grad_norm"]) <= TOL, row
        if case.endswith("/0.5"):
            assert rows[case]["dropped"] > 0.1 and rows[case]["loss"] > 1e-5, rows[case]
            continue
        assert rows[case]["dropped"] == 0.0, rows[case]
        for what in ("loss", "grad_norm", "params"):
            assert rows[case][what] <= TOL, f"{case}: {what} differs from one device by {rows[case][what]:.3g}"
