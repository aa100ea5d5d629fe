"""Checkpoints that survive damage and kills, on real run directories.

- Damage (truncated array file, garbage JSON, bytes changed in place) is named by step and item
  (params / train / meta); ``sample``/``eval`` fall back to the newest intact step with one line on
  stderr, or refuse an explicit ``--step``; ``train`` resumes there and reproduces the losses.
- Pruning never deletes the last good step while a newer one has not been read back.
- SIGKILL during a save (model large enough that a save takes a few hundred ms): the previous
  step stays restorable and the resumed run logs the uninterrupted run's losses bit for bit.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from jaxgpt.cli import main
from jaxgpt.config import apply_sets
from jaxgpt.config import get_preset
from jaxgpt.train.checkpoint import FILES, Checkpoints, DamagedCheckpoint

pytestmark = pytest.mark.e2e  # training runs through the command line: make test-slow

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "d_ff=64", "--set", "batch_size=4", "--set", "seq_len=16",
        "--set", "steps=6", "--set", "ckpt_every=2", "--set", "keep=3", "--set", "eval_every=0", "--set", "log_every=1",
        "--set", "eval_batches=1"]
TRAIN = ["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", *TINY, "--quiet"]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _largest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(step: Path, item: str) -> None:
    f = _largest(step / item)
    os.truncate(f, f.stat().st_size // 3)


def _garble(step: Path, item: str) -> None:
    (step / "meta" / "metadata").write_bytes(b"\x00not json{")


def _swap(step: Path, item: str) -> None:
    """A valid item from another step (step 4) in place of this one: it decodes without any error,
    so only the checksums saved with step 6 can tell. (Zeroing bytes in place is not a reliable
    stand-in: where they land in the compressed file depends on orbax's write order, and a hit on
    a zstd frame header is a read error, not a silent change.)"""
    shutil.rmtree(step / item)
    shutil.copytree(step.parent / "4" / item, step / item)


def _flip(step: Path, item: str) -> None:
    """Same size, different bytes: zstd chunks may decode to other numbers without any error."""
    f = _largest(step / item)
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(16)
    f.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("robust") / "run"
    assert main([*TRAIN, "--out", str(out)]) == 0
    assert Checkpoints(out, create=False).steps() == [2, 4, 6]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("damage, item, table, message", [
    (_truncate, "params", True, r"params file ocdbt.process_0/d/\w+ has \d+ bytes; \d+ were saved"),
    (_garble, "meta", True, r"meta file metadata has 10 bytes; \d+ were saved"),
    (_flip, "params", True, r"params file ocdbt.process_0/d/\w+ has changed since it was saved"),
    # without the file table (older checkpoints, or a step killed before it was read back):
    (_truncate, "params", False, r"params is unreadable \(OUT_OF_RANGE: .{20,200}\)"),
    (_garble, "meta", False, r"meta is unreadable \(Expecting value: line 1 column 1 \(char 0\)\)"),
    (_swap, "params", False, r"params does not match the checksums saved with it \(\d+ of \d+ arrays differ, first "
                             r"params\['[\w\]\['\.]+\]\)"),
], ids=["truncated-params", "garbage-meta", "changed-params", "truncated-params-notable", "garbage-meta-notable",
        "changed-params-notable"])
def test_damage_is_named_and_sample_eval_fall_back(run, tmp_path, capsys, damage, item, table, message):
    run = _copy(run, tmp_path)
    step6 = run / "checkpoints" / "6"
    if not table:
        (step6 / FILES).unlink()
    damage(step6, item)
    capsys.readouterr()

    assert main(["sample", "--ckpt", str(run), "--prompt", "ab", "--temperature", "0", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert line.startswith(f"jaxgpt: warning: damaged checkpoint in '{run / 'checkpoints'}' (step 6: ")
    assert line.endswith("; using step 4, the newest intact one")
    assert re.search(message, line), line
    assert "--- greedy ---\nab" in out

    assert main(["eval", "--ckpt", str(run)]) == 0
    assert "using step 4" in _one_line(capsys.readouterr().err)

    assert main(["sample", "--ckpt", str(run), "--prompt", "ab", "--step", "6"]) == 2  # asked for it: refuse
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"jaxgpt sample: error: checkpoint step 6 in '{run / 'checkpoints'}' is damaged: {item} ")
    assert line.endswith("; other saved steps: [2, 4]") and re.search(message, line)
    with pytest.raises(DamagedCheckpoint) as e:
        Checkpoints(run, create=False).restore_params(6)
    assert (e.value.step, e.value.item) == (6, item)


def test_nothing_intact_is_one_error(run, tmp_path, capsys):
    run = _copy(run, tmp_path)
    for s in (2, 4, 6):
        _garble(run / "checkpoints" / str(s), "meta")
    assert main(["eval", "--ckpt", str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("jaxgpt eval: error: no intact checkpoint: damaged checkpoints in ")
    assert all(f"step {s}: meta file metadata" in line for s in (2, 4, 6))


def test_train_resumes_from_the_newest_intact_step(run, tmp_path, capsys):
    """Damaged train item (sampling would still work from step 6): train resumes from 4, says so
    in one line, moves step 6 aside (kept), and logs the original losses bit for bit."""
    ref = _losses(run)
    run = _copy(run, tmp_path)
    _truncate(run / "checkpoints" / "6", "train")
    capsys.readouterr()
    assert main([*TRAIN, "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert "(step 6: train file ocdbt.process_0/d/" in line
    assert line.endswith("; resuming from step 4, the newest intact one (moved aside: 6.damaged)")
    assert "resuming at step 4" in out
    assert (run / "checkpoints" / "6.damaged" / "train").is_dir()
    assert Checkpoints(run, create=False).steps() == [2, 4, 6]
    assert _losses(run) == ref


def test_prune_waits_until_the_newer_step_reads_back(tmp_path):
    """keep=1: step 1 survives until step 2 has been read back intact; a step 2 damaged before
    its read-back is reported and step 1 is kept."""
    config, tc = apply_sets(get_preset("seed-minigpt"), ["n_layer=1", "d_model=32", "keep=1"])
    from jaxgpt.train import init_state

    state = init_state(config, tc)
    for damage_new in (False, True):
        notes: list[str] = []
        # background=False: the damage goes in between the write and the read-back
        ckpts = Checkpoints(tmp_path / f"run{damage_new}", keep=1, log=notes.append, background=False)
        ckpts.save(state.replace(step=jax.numpy.int32(1)), {"config": config.to_dict(), "train": tc.to_dict()})
        ckpts.save(state.replace(step=jax.numpy.int32(2)), {"config": config.to_dict(), "train": tc.to_dict()})
        assert ckpts.steps() == [1, 2]  # 1 verified, 2 not yet: nothing pruned
        ckpts._mngr.wait_until_finished()
        if damage_new:
            _truncate(ckpts.dir / "2", "params")
        ckpts.wait()
        if damage_new:
            assert ckpts.steps() == [1, 2] and len(notes) == 1
            assert notes[0].startswith(f"checkpoint step 2 in '{ckpts.dir}' is damaged: params is unreadable")
            assert Checkpoints(ckpts.dir, create=False, log=notes.append).restore()[2].step == 1
        else:
            assert ckpts.steps() == [2] and notes == []
        ckpts.close()


def test_background_read_back_verifies_each_save_while_training_goes_on(tmp_path):
    """A single-process run reads each save back on a thread: after save(1), save(2), save(3) and
    wait(), steps 1 and 2 were verified (so pruned with keep=1) and 3 is verified and tabled; an
    error on the thread is raised by wait()."""
    config, tc = apply_sets(get_preset("seed-minigpt"), ["n_layer=1", "d_model=32", "keep=1"])
    from jaxgpt.train import init_state

    state, meta = init_state(config, tc), {"config": config.to_dict(), "train": tc.to_dict()}
    notes: list[str] = []
    ckpts = Checkpoints(tmp_path / "run", keep=1, log=notes.append)
    assert ckpts.background  # the default in one process
    readers = []
    for step in (1, 2, 3):
        ckpts.save(state.replace(step=jax.numpy.int32(step)), meta)
        readers.append(ckpts._reader)
    assert all(r is not None and r.name == "jaxgpt-checkpoint-read-back" for r in readers)
    readers[-1].join()
    assert ckpts._unverified == [] and ckpts._verified == {1, 2, 3}  # read back on the thread, not by wait()
    ckpts.wait()
    assert ckpts.steps() == [3] and notes == [] and (ckpts.dir / "3" / FILES).is_file()
    ckpts._load = lambda *a, **k: 1 / 0  # the next read-back fails on the thread...
    ckpts.save(state.replace(step=jax.numpy.int32(4)), meta)
    with pytest.raises(ZeroDivisionError):  # ...and the caller hears of it
        ckpts.wait()
    ckpts.close()


# --- SIGKILL during a save --------------------------------------------------------------------------------------

BIG = ["--set", "d_model=256", "--set", "n_layer=4", "--set", "d_ff=1024", "--set", "batch_size=2", "--set",
       "seq_len=16", "--set", "steps=6", "--set", "ckpt_every=2", "--set", "keep=2", "--set", "eval_every=0",
       "--set", "log_every=1", "--set", "eval_batches=1", "--set", "dropout=0.1"]


@pytest.mark.multiprocess  # three SIGKILLed training subprocesses: make test-slow
def test_sigkill_during_a_save_keeps_the_previous_step_and_resumes_exactly(tmp_path, capsys):
    """~4.2M parameters (a 50 MB state): a save takes a few hundred ms. Three runs at once, each
    killed with SIGKILL while step 4 is being written (orbax's ``4.orbax-checkpoint-tmp`` exists)
    after a different delay: step 2 stays restorable, and rerunning the command resumes and logs
    the uninterrupted run's losses bit for bit (batches and dropout keys are functions of the step)."""
    args = ["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", *BIG, "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    delays = (0.0, 0.1, 0.25)
    runs = [tmp_path / f"run{i}" for i in range(len(delays))]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxgpt", *args, "--out", str(r)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in runs]
    try:
        seen: dict[int, float] = {}
        deadline = time.time() + 300
        while len(seen) < len(runs) or any(procs[i].returncode is None for i in seen):
            for i, (run, proc) in enumerate(zip(runs, procs)):
                if proc.poll() is not None:
                    continue
                if i not in seen and list((run / "checkpoints").glob("4.orbax-checkpoint-tmp*")):
                    seen[i] = time.perf_counter()
                if i in seen and time.perf_counter() - seen[i] >= delays[i]:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
            assert all(p.returncode in (None, -signal.SIGKILL) for p in procs), \
                [p.stderr.read().decode()[-2000:] for p in procs if p.returncode not in (None, -signal.SIGKILL)]
            assert time.time() < deadline, "no step-4 save in time"
            time.sleep(0.002)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert main([*args, "--out", str(tmp_path / "ref")]) == 0  # the uninterrupted run
    ref = _losses(tmp_path / "ref")
    interrupted = 0
    for run in runs:
        ckpt = Checkpoints(run, create=False)
        steps = ckpt.steps()
        interrupted += 4 not in steps
        assert 2 in steps and max(steps) <= 4, steps
        assert int(ckpt.restore(2)[2].step) == 2  # the previous step is intact
        ckpt.close()
        capsys.readouterr()
        assert main([*args, "--out", str(run)]) == 0  # the same command again resumes
        assert f"resuming at step {max(steps)}" in capsys.readouterr().out
        got = _losses(run)
        assert sorted(got) == list(range(1, 7))
        assert [got[s] for s in range(1, 7)] == [ref[s] for s in range(1, 7)]  # bit for bit
        # keep=2 verified steps: a step 4 left by the killed process was never read back by the
        # process that saves step 6, so it does not count towards `keep` and step 2 stays.
        assert Checkpoints(run, create=False).steps() == ([2, 4, 6] if 4 in steps else [4, 6])
    assert interrupted >= 1, "every kill landed after step 4 was complete: no save was interrupted"
