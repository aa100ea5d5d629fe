"""One process of test_multihost.py's two-process runs: jax.distributed on localhost, one CPU device
per process, the mesh fsdp=2 spanning both. Prints one ``RESULT {json}`` line; the test asserts.

    python multihost_worker.py PORT PID first ROOT   # fit ROOT/ref for 6 steps; fit ROOT/run, Ctrl-C after step 3
    python multihost_worker.py PORT PID resume ROOT  # `jaxgpt train` into ROOT/run again: resumes at step 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()


def note(what: str) -> None:
    """A timestamped line in the output the test shows when it fails (where did the time go?)."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)

MESH = "fsdp=2"
SETS = ["n_layer=1", "d_model=32", "d_ff=64", "batch_size=4", "seq_len=16", "steps=6", "ckpt_every=2", "keep=3",
        "eval_every=0", "log_every=1", "eval_batches=1", "dropout=0.1"]  # dropout: the restored rng matters
INTERRUPT_AT = 3  # the batch of step index 3 raises KeyboardInterrupt: 3 updates done, step 3 saved by fit


class Interrupted:
    """A Task whose batch for step index ``at`` raises KeyboardInterrupt, on every process alike
    (as a Ctrl-C or a preemption notice handled at the same step everywhere)."""

    def __init__(self, task, at: int):
        self.task, self.at = task, at

    def __getattr__(self, name):
        return getattr(self.task, name)

    def batch(self, tc, step: int):
        if step == self.at:
            raise KeyboardInterrupt
        return self.task.batch(tc, step)


def first(port: str, pid: int, root: Path) -> dict:
    from jaxgpt.cli.common import start_devices

    start_devices(argparse.Namespace(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, mesh=MESH))
    import jax

    note("jax.distributed started")
    from jaxgpt.config import apply_sets, get_preset
    from jaxgpt.train.loop import fit, prepare

    config, tc = apply_sets(get_preset("seed-minigpt"), SETS)
    out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
           "local_devices": jax.local_device_count()}
    for name, at in (("ref", None), ("run", INTERRUPT_AT)):
        config_, tc_, task, state = prepare(root / name, config, tc.replace(mesh=MESH), corpus="seed-synthetic")
        try:
            fit(config_, tc_, task if at is None else Interrupted(task, at), root / name, state=state, progress=False)
            out[name] = "finished"
        except KeyboardInterrupt:
            out[name] = "interrupted"
        note(f"{name}: {out[name]}")
    return out


def resume(port: str, pid: int, root: Path) -> dict:
    from jaxgpt.cli import main

    sets = [a for s in SETS for a in ("--set", s)]
    rc = main(["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", *sets, "--quiet", "--mesh", MESH,
               "--out", str(root / "run"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(pid)])
    import jax

    note(f"resumed: exit code {rc}")
    return {"process": jax.process_index(), "rc": rc}


if __name__ == "__main__":
    port, pid, phase, root = sys.argv[1:]
    try:
        result = {"first": first, "resume": resume}[phase](port, int(pid), Path(root))
    except BaseException:  # noqa: BLE001 - exit now: a normal exit waits at jax.distributed's shutdown barrier
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result), flush=True)
