"""The global batch of a token-file run is the same for 1 and 2 processes, and each of the two
processes reads only its half of the rows (tokenfiles_worker.py: jax.distributed on localhost,
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

from parity_tests.test_multihost import REPO, _free_port

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).with_name("tokenfiles_worker.py")
LAUNCH_S = 120


def test_one_and_two_processes_see_the_same_global_batches(tmp_path):
    from parity_tests.tokenfiles_worker import SETS, STEPS

    from jaxgpt.config import TrainConfig
    from jaxgpt.train.token_task import token_task

    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50, 20_000).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, 50, 2_000).astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 50, "dtype": "uint16", "tokenizer": None}))

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    port = str(_free_port())
    logs = [tmp_path / f"{i}.log" for i in range(2)]
    files = [p.open("w") for p in logs]
    procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), str(d)], env=env, cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT) for i, f in enumerate(files)]
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
