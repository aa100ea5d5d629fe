"""One process of test_tokenfiles_multihost.py: jax.distributed on localhost, one CPU device per
process, mesh data=2. Builds the token task's batches for a few steps, places them on the mesh as
fit does (shard_batch), gathers the global arrays back and prints ``RESULT {json}``.

    python tokenfiles_worker.py PORT PID DATA_DIR            # the batches of STEPS
    python tokenfiles_worker.py PORT PID DATA_DIR OUT        # `jaxgpt train --data DATA_DIR --mesh data=2` into OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

MESH, SETS = "data=2", {"batch_size": 8, "grad_accum": 2, "seq_len": 16, "seed": 5}
STEPS = (0, 1, 7)


def run(port: str, pid: int, data: str) -> dict:
    from jaxgpt.cli.common import start_devices

    start_devices(argparse.Namespace(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, mesh=MESH))
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxgpt.config import TrainConfig
    from jaxgpt.parallel.sharding import make_mesh, shard_batch
    from jaxgpt.data.token_task import token_task

    tc = TrainConfig(**SETS, mesh=MESH)
    task = token_task(data, tc)
    mesh = make_mesh(MESH)
    out = {"process": jax.process_index(), "batches": {}}
    for step in STEPS:
        placed = shard_batch(task.batch(tc, step), mesh)
        out["batches"][step] = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).tolist()
                                for k, v in placed.items()}
    out["reads"] = task.train[0].reads
    return out


TRAIN_SETS = ["n_layer=1", "d_model=32", "d_ff=64", "batch_size=8", "grad_accum=2", "seq_len=16", "steps=4",
              "eval_every=0", "eval_batches=1", "log_every=1", "ckpt_every=0"]


def train(port: str, pid: int, data: str, out: str) -> dict:
    from jaxgpt.cli import main

    rc = main(["train", "--preset", "seed-minigpt", "--data", data, *[a for s in TRAIN_SETS for a in ("--set", s)],
               "--quiet", "--mesh", MESH, "--out", out, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(pid)])
    return {"rc": rc}


if __name__ == "__main__":
    port, pid, data, *out = sys.argv[1:]
    try:
        result = train(port, int(pid), data, out[0]) if out else run(port, int(pid), data)
    except BaseException:  # noqa: BLE001 - exit now: a normal exit waits at jax.distributed's shutdown barrier
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result), flush=True)
