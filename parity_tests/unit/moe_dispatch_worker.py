"""Subprocess side of test_moe_dispatch.py: runs with 8 simulated CPU devices (set by the caller through
XLA_FLAGS before JAX starts) and prints one JSON line: the expert-parallel ('alltoall') train step on
MESH against the single-device step of the dense impl, per capacity factor, and with a factor against
torch_ref's train step with the capacity rule applied to each device's token group (torch_ref's MoE keeps
its rule, ``kept``, and sees the whole batch as one group: the reference splits its (token, expert)
picks into the mesh's groups, contiguous rows as the batch is split, and runs ``kept`` on each).

    python moe_dispatch_worker.py MESH/CF [MESH/CF...]  # e.g. data=2,expert=4/0.5; CF 'none': dropless
"""
from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from jaxgpt.config import Execution, ModelConfig, MoEConfig, TrainConfig  # noqa: E402 - after the setup above, which must run first
from jaxgpt.config.mesh import batch_devices  # noqa: E402 - after the setup above, which must run first
from jaxgpt.parallel.sharding import make_mesh, shard_batch  # noqa: E402 - after the setup above, which must run first
from jaxgpt.train.step import init_state, make_train_step  # noqa: E402 - after the setup above, which must run first

# 8 experts, top-2; rolled layer scans; the router losses in the objective (TrainConfig defaults)
DENSE = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_ff=48, max_len=16, pos="rope",
                    moe=MoEConfig(n_experts=8, top_k=2, d_ff=16))
TC = TrainConfig(steps=10, batch_size=8, seq_len=8, mesh="",  # mesh='': the reference runs on one device
                 execution=Execution(scan_unroll=1))


def batch() -> dict:
    x = np.random.default_rng(0).integers(0, 64, (1, 8, 8)).astype(np.int32)  # (A, B, T)
    return {"x": x, "y": np.roll(x, -1, axis=-1)}


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@functools.cache
def reference():
    """The dense impl (dropless, another code path) on one device: (state after one step, metrics)."""
    return make_train_step(DENSE, TC)(init_state(DENSE, TC), batch())


def torch_grouped(cfg, groups: int) -> dict:
    """torch_ref's train step on the same initial weights and batch, each MoE layer dropping by its
    capacity rule within each of ``groups`` equal token groups -> its metrics (loss, expert_dropped, ...)."""
    import torch

    import torch_ref
    from torch_ref.convert import load_params
    from torch_ref.nn.moe import MoE
    from torch_ref.train import make_optimizer, train_step

    model = load_params(torch_ref.build(cfg), jax.device_get(init_state(cfg, TC).params))
    for m in model.modules():
        if isinstance(m, MoE):
            whole = m.kept  # (N, k) -> (N, k) bool, its capacity from N: per group, from the group's tokens
            m.kept = lambda idx, whole=whole: torch.cat([whole(g) for g in idx.chunk(groups)])
    return train_step(model, *make_optimizer(model, TC), TC, batch())


def run(spec: str, cf: float | None) -> dict:
    cfg = DENSE.replace(moe=DENSE.moe.replace(impl="alltoall", capacity_factor=cf))
    ref, m_ref = reference()
    mesh = make_mesh(spec)
    step, placed = make_train_step(cfg, TC, mesh=mesh), shard_batch(batch(), mesh)
    s1, m = step(init_state(cfg, TC, mesh=mesh), placed)
    hlo = step.lower(s1, placed).compile().as_text()
    return {"loss": abs(float(m["loss"]) - float(m_ref["loss"])),
            "grad_norm": abs(float(m["grad_norm"]) - float(m_ref["grad_norm"])),
            "params": max_diff(ref.params, s1.params), "all_to_all": hlo.count("all-to-all("),
            "dropped": float(m["expert_dropped"]), **({} if cf is None else torch_diffs(cfg, mesh, m))}


def torch_diffs(cfg, mesh, m) -> dict:
    """|jaxgpt - torch_ref per group| of the loss, grad norm and expert_dropped, and the reference's dropped share."""
    groups = batch_devices(dict(mesh.shape))
    ref = torch_grouped(cfg, groups)
    return {"torch_loss": abs(float(m["loss"]) - ref["loss"]), "torch_grad_norm": abs(float(m["grad_norm"]) - ref["grad_norm"]),
            "torch_dropped": ref["expert_dropped"],
            "torch_dropped_diff": abs(float(m["expert_dropped"]) - ref["expert_dropped"]), "groups": groups}


if __name__ == "__main__":
    out = {}
    for arg in sys.argv[1:]:
        spec, cf = arg.split("/")
        out[arg] = run(spec, None if cf == "none" else float(cf))
    print("RESULT " + json.dumps(out), flush=True)
