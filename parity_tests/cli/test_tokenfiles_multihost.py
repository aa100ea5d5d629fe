"""The global batch of a token-file run is the same for 1 and 2 processes, and each of the two
processes reads only its half of the rows; a 2-process `jaxgpt train --data DIR` matches the
1-process run; a SIGKILLed token-file run resumes bit-exact (tokenfiles_worker.py: jax.distributed on localhost,
one CPU device per process, mesh data=2; the batches are placed as fit places them and gathered
back). The 1-process reference is the plain task batch in this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli.test_multihost import REPO, _free_port
from conftest import xla_flags

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).with_name("tokenfiles_worker.py")
LAUNCH_S = 120


def token_dir(d: Path) -> Path:
    d.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50, 20_000).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, 50, 2_000).astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 50, "dtype": "uint16", "tokenizer": None}))
    return d


def launch(tmp_path: Path, *args) -> list[dict]:
    """Both worker processes with ``args``; their RESULT dicts, process 0 first."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    port = str(_free_port())
    logs = [tmp_path / f"{i}.log" for i in range(2)]
    files = [p.open("w") for p in logs]
    procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), *map(str, args)], env=env, cwd=REPO,
                              stdout=f, stderr=subprocess.STDOUT) for i, f in enumerate(files)]
    try:
        for p in procs:
            p.wait(timeout=LAUNCH_S)
    finally:
        for p, f in zip(procs, files):
            if p.poll() is None:
                p.kill()
                p.wait()
            f.close()
    results = []
    for p, log in zip(procs, logs):
        out = log.read_text()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, out[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def test_one_and_two_processes_see_the_same_global_batches(tmp_path):
    from parity_tests.cli.tokenfiles_worker import SETS, STEPS

    from jaxgpt.config import TrainConfig
    from jaxgpt.data.token_task import token_task

    d = token_dir(tmp_path / "data")
    results = launch(tmp_path, d)
    tc = TrainConfig(**SETS)  # one process, no mesh: every row read here
    task = token_task(str(d), tc)
    for step in STEPS:
        want = task.batch(tc, step)
        for r in results:
            for k in ("x", "y"):
                np.testing.assert_array_equal(np.asarray(r["batches"][str(step)][k]), want[k],
                                              err_msg=f"process {r['process']} step {step} {k}")
    # each process read its 4 of the 8 rows per step, not the global batch
    assert [r["reads"] for r in results] == [len(STEPS) * 4] * 2


def test_two_process_training_on_token_files_matches_one_process(tmp_path):
    """`jaxgpt train --data DIR --mesh data=2` as 2 processes (one device each) and as 1 process
    (two host devices): the same losses, to 1e-6 relative (the cross-process all-reduce need not
    add in the in-process order; different batches would differ by far more)."""
    from parity_tests.cli.tokenfiles_worker import MESH, TRAIN_SETS

    d = token_dir(tmp_path / "data")
    assert [r["rc"] for r in launch(tmp_path, d, tmp_path / "two")] == [0, 0]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "jaxgpt", "train", "--preset", "seed-minigpt", "--data", str(d), "--quiet",
                    "--mesh", MESH, "--out", str(tmp_path / "one"), *[a for s in TRAIN_SETS for a in ("--set", s)]],
                   env=env, cwd=REPO, check=True, capture_output=True, timeout=LAUNCH_S)

    def losses(out):
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    np.testing.assert_allclose(two, one, rtol=1e-6, atol=0)


def test_sigkilled_token_file_run_resumes_bit_exact(tmp_path):
    """`jaxgpt train --data DIR` SIGKILLed mid-run (after a checkpoint, between two) and rerun with
    the same command ends with the uninterrupted run's losses and weights, bit for bit."""
    import signal
    import time

    import jax

    from jaxgpt.train.checkpoint import FILES, Checkpoints

    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(1)
    rng.integers(0, 50, 50_000).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, 50, 2_000).astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 50, "dtype": "uint16", "tokenizer": None}))
    sets = ["n_layer=1", "d_model=32", "d_ff=64", "batch_size=4", "seq_len=16", "steps=400", "ckpt_every=100",
            "eval_every=0", "log_every=1", "dropout=0.1"]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))

    def cmd(out):
        return [sys.executable, "-m", "jaxgpt", "train", "--preset", "seed-minigpt", "--data", str(d), "--quiet",
                "--out", str(out), *[a for s in sets for a in ("--set", s)]]

    subprocess.run(cmd(tmp_path / "ref"), env=env, cwd=REPO, check=True, capture_output=True, timeout=LAUNCH_S)
    run = tmp_path / "run"
    p = subprocess.Popen(cmd(run), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + LAUNCH_S
    # Saves are asynchronous: on a loaded machine the run can be 30 steps past 100 while step 100
    # is still being written, so wait for its file table (written once the step is read back).
    verified = run / "checkpoints" / "100" / FILES
    while p.poll() is None and time.monotonic() < deadline:
        if verified.exists():
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    r = subprocess.run(cmd(run), env=env, cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_S)
    assert r.returncode == 0 and "resuming at step" in r.stdout, r.stdout + r.stderr

    def losses(out):
        return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "loss" in row}

    assert losses(run) == losses(tmp_path / "ref") and len(losses(run)) == 400
    _, _, a, _ = Checkpoints(run, create=False).restore()
    _, _, b, _ = Checkpoints(tmp_path / "ref", create=False).restore()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
