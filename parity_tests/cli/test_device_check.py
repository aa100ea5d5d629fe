"""scripts/device_check.py (``make device-check``), the one command a lent GPU runs: its dry run end to end
(every step at toy size on the CPU, through the Makefile, into a temporary $OUT), and the driver's own rules:
a failed or timed-out step is reported and the next one still runs, pytest's counts read from a cut-off log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import device_check

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["train B 12 (toy B 2)", "train B 32 (toy B 2)", "cached decoding", "serving engine", "GPU test tier"]


@pytest.mark.slow  # make test-slow: five steps, each in its own processes (about a minute on 2 cores)
def test_dry_run_reports_every_target(tmp_path):
    from conftest import SHARED, require_shared

    require_shared(SHARED / "reference" / "nanogpt" / "model.py")
    p = subprocess.run(["make", "--no-print-directory", "device-check", "DRY_RUN=1", f"DEVICE_PYTHON={sys.executable}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    tag = "device-check [dry run: toy sizes on this machine, not a measurement] "
    lines = [x[len(tag):] for x in p.stdout.splitlines() if x.startswith(tag)]
    steps = [x for x in lines if x.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == [f"step {s}" for s in device_check.STEPS], steps
    assert all(": ok (" in s for s in steps), steps
    found = {t: x for t in TARGETS for x in lines if x.startswith(t + ": ")}
    assert list(found) == TARGETS, lines
    for t, x in found.items():  # a ratio measured on each, or the tier's counts; toy ratios judge nothing
        assert re.search(r": (MET|MISSED)( - |$)", x), x
        if t != "GPU test tier":
            assert re.match(re.escape(t) + r": \d+\.\d\dx \(target >= ", x), x
    assert found["GPU test tier"].startswith("GPU test tier: 1 passed") and found["GPU test tier"].endswith(": MET")
    assert re.search(r"float32 tokens: \d/2 identical", found["serving engine"]), found["serving engine"]
    engine = tmp_path / "results" / "engine"
    md = (engine / "gpu_check.md").read_text()
    assert "**Dry run**" in md and md.count("| MET |") + md.count("| MISSED |") == len(TARGETS), md
    assert json.loads((engine / "gpu_check.json").read_text())["dry_run"] is True
    for name in ("race", "decode", "serving"):
        assert (engine / f"gpu_check_{name}.md").is_file(), name


def test_a_failed_or_timed_out_step_is_reported_and_the_next_runs(tmp_path, monkeypatch):
    """Fake steps: race exits 3 at once, decode outlives its 1 s budget and the 3 s race left (a child of its
    own too), the tier ends as pytest does with a failed test; the run exits 1 and reports each."""
    fake = {"race": "import sys; sys.exit(3)",
            "decode": "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
                      "time.sleep(60)']); print('child', c.pid, flush=True); time.sleep(60)",
            "tier": "import sys; print('FAILED parity_tests/test_mlp.py::test_x - 1e-3 > 1e-5'); "
                    "print('=== 1 failed, 3 passed, 1 skipped in 2.0s ==='); sys.exit(1)"}
    monkeypatch.setattr(device_check, "command", lambda step, ctx: ([sys.executable, "-c", fake[step]], {}))
    rc = device_check.main(["--only", "race,decode,tier", "--budget", "race=3", "--budget", "decode=1", "--out",
                            str(tmp_path)])
    engine = tmp_path / "results" / "engine"
    result = json.loads((engine / "gpu_check.json").read_text())
    assert rc == 1
    child = int((engine / "gpu_check_logs" / "decode.log").read_text().split()[1])
    for _ in range(50):  # the timed-out step's own child was ended with it (then reaped by init)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the timed-out step's child {child} still runs")
    steps = result["steps"]
    assert steps["race"]["error"].startswith("exited with 3") and "timed out" in steps["decode"]["error"]
    assert 3 <= steps["decode"]["budget_s"] <= 4  # its own 1 s and what race left of its 3
    assert steps["decode"]["wall_s"] < 15 and steps["tier"]["error"].startswith("exited with 1")
    status = {t["target"]: (t["status"], t["value"]) for t in result["targets"]}
    assert status == {"train B 12": ("FAILED", "-"), "train B 32": ("FAILED", "-"), "cached decoding": ("FAILED", "-"),
                      "GPU test tier": ("MISSED", "1 failed, 3 passed, 1 skipped")}, status  # ran: a result
    assert result["targets"][-1]["detail"] == "first failures: parity_tests/test_mlp.py::test_x"


def test_tier_counts_from_a_final_line_or_a_cut_off_log():
    assert device_check.tier_counts("x\n==== 2 failed, 247 passed, 19 skipped in 95.10s (0:01:35) ====\n") == \
        {"failed": 2, "passed": 247, "skipped": 19}
    assert device_check.tier_counts("....F..s. [ 40%]\nparity_tests/test_mlp.py ..E\n") == \
        {"passed (cut off)": 9, "failed (cut off)": 1, "errors (cut off)": 1, "skipped (cut off)": 1}
    met, missed = device_check.target("t", "g", 1.0, 1.0), device_check.target("t", "g", 0.99, 1.0)
    assert (met["status"], missed["status"], device_check.target("t", "g", None, 1.0)["status"]) == \
        ("MET", "MISSED", "FAILED")


def test_no_step_starts_past_the_total(tmp_path):
    rc = device_check.main(["--only", "tier", "--total", "5", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results" / "engine" / "gpu_check.json").read_text())
    assert rc == 1 and result["steps"]["tier"]["error"] == "not started: 5 s left of --total 5", result["steps"]
    assert [(t["target"], t["status"]) for t in result["targets"]] == [("GPU test tier", "FAILED")]


def test_a_terminated_driver_ends_its_running_step(tmp_path):
    """SIGTERM to the driver (the device tool's limit, a person's kill) ends the step it is running, whose
    session is its own, instead of leaving it on the GPU."""
    script = ("import sys; from scripts import device_check as d; d.command = lambda step, ctx: ([sys.executable, "
              "'-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(60)'], {}); "
              f"sys.exit(d.main(['--only', 'env', '--out', {str(tmp_path)!r}]))")
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    log = tmp_path / "results" / "engine" / "gpu_check_logs" / "env.log"
    for _ in range(200):  # until the step has started and said its pid
        if log.is_file() and log.read_text().strip():
            break
        time.sleep(0.05)
    step = int(log.read_text())
    driver.terminate()
    assert driver.wait(timeout=30) == 143
    for _ in range(50):
        try:
            os.kill(step, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the step {step} outlived its terminated driver")
