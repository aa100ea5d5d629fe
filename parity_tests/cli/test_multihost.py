"""``fit`` and ``Checkpoints`` across two processes: jax.distributed on localhost, one CPU device per
process, the mesh fsdp=2 spanning both (multihost_worker.py; the assertions are here).

Launch 1 trains ROOT/ref for 6 steps, then ROOT/run, interrupted (KeyboardInterrupt on both
processes) after step 3, which fit saves. Launch 2 reruns ``jaxgpt train --coordinator ...`` into
ROOT/run: it resumes at step 3. Checked: metrics.jsonl holds every step once (process 0 writes it;
a second writer would duplicate or cut rows), the steps' file tables and loss.png exist, the
checkpoints restore in this process onto one device, and the resumed run's losses and final weights
equal the uninterrupted run's bit for bit (same mesh, same batches, dropout keys from the step;
CPU reductions are deterministic).

Time: compiling dominates (about 7 programs per fit), so the workers share a persistent
compilation cache in the test's tmp folder: the second fit and the resume load most programs.
Measured on the 2-core machine while other test runs kept it at load 10: 77 s + 22 s; each
launch is capped at LAUNCH_S, and a hang (a barrier one process never reaches) fails there.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxgpt.train.checkpoint import FILES, Checkpoints
from conftest import xla_flags

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = Path(__file__).resolve().parents[2]
LAUNCH_S = 150  # per two-process launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase: str, root: Path) -> list[dict]:
    """Both processes of one phase; their RESULT dicts (with the output under 'log'), process 0 first."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())  # the worker asks for its own host devices
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(root / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    port = str(_free_port())
    logs = [root / f"{phase}.{i}.log" for i in range(2)]  # files, not pipes: a full pipe would stall a worker
    files = [path.open("w") for path in logs]
    procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), phase, str(root)], env=env, cwd=REPO,
                              stdout=f, stderr=subprocess.STDOUT, text=True) for i, f in enumerate(files)]
    deadline = time.monotonic() + LAUNCH_S
    try:  # a process that fails leaves the other waiting at a barrier: stop both at once
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p, f in zip(procs, files):
            if p.poll() is None:
                p.kill()
            p.wait()
            f.close()
    outs = [path.read_text() for path in logs]
    if time.monotonic() >= deadline:
        pytest.fail(f"{phase}: the two processes ran past {LAUNCH_S} s:\n" + "\n".join(o[-2000:] for o in outs))
    results = []
    for p, out in zip(procs, outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"{phase}: process {p.args[3]} failed:\n{out[-3000:]}"
        results.append({**json.loads(lines[-1][len("RESULT "):]), "log": out})
    return results


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run) if "loss" in r}


def test_fit_checkpoints_and_resume_across_two_processes(tmp_path):
    t0 = time.perf_counter()
    ref, run = tmp_path / "ref", tmp_path / "run"

    a, b = launch("first", tmp_path)
    assert [(r["process"], r["processes"], r["devices"], r["local_devices"]) for r in (a, b)] == [(0, 2, 2, 1),
                                                                                                 (1, 2, 2, 1)]
    assert a["ref"] == b["ref"] == "finished" and a["run"] == b["run"] == "interrupted"
    # one writer: each step's row once (two writers append every row twice)
    assert [r["step"] for r in rows(ref) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows(ref) if "val_loss" in r] == [6]
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert Checkpoints(run, create=False).steps() == [2, 3]  # step 3: saved on the interrupt

    a, b = launch("resume", tmp_path)
    assert a["rc"] == b["rc"] == 0, a["log"][-2000:] + b["log"][-2000:]
    assert "resuming at step 3" in a["log"] and "resuming at step 3" in b["log"]
    got, want = rows(run), rows(ref)
    assert [r["step"] for r in got if "loss" in r] == [1, 2, 3, 4, 5, 6], got
    assert [r["step"] for r in got if "val_loss" in r] == [6]
    # bit for bit: steps 4..6 ran after the restore, in new processes
    assert losses(run) == losses(ref)
    assert [r["val_loss"] for r in got if "val_loss" in r] == [r["val_loss"] for r in want if "val_loss" in r]
    for d in (ref, run):
        assert (d / "loss.png").is_file() and not (d / "metrics.jsonl.tmp").exists()
        steps = Checkpoints(d, create=False).steps()
        assert all((d / "checkpoints" / str(s) / FILES).is_file() for s in steps), steps  # read back, tabled
    assert Checkpoints(ref, create=False).steps() == [2, 4, 6]
    assert Checkpoints(run, create=False).steps() == [2, 3, 4, 6]  # keep=3 verified by one run: none pruned yet

    # the two-process checkpoints restore here (one device), and the resumed weights are the uninterrupted ones
    _, _, s_run, _ = Checkpoints(run, create=False).restore()
    _, _, s_ref, _ = Checkpoints(ref, create=False).restore()
    assert int(s_run.step) == int(s_ref.step) == 6
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(s_run), jax.tree_util.tree_leaves(s_ref)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    assert time.perf_counter() - t0 < 2 * LAUNCH_S
