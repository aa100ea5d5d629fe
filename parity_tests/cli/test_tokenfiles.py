"""Token-file datasets (jaxgpt.data.tokenfiles, jaxgpt.data.token_task) through `jaxgpt train/eval/sample`.

nanoGPT's format is written here the way nanoGPT's data/shakespeare_char/prepare.py writes it
(uint16 ``np.array(ids).tofile``, meta.pkl = {'vocab_size', 'itos', 'stoi'}); the reference for
what the files hold is that independent encoding, not jaxgpt's tokenizer. One tiny model shape
(SETS) throughout, so the compiled programs are shared.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxgpt.cli import main
from jaxgpt.config import apply_sets, get_preset
from jaxgpt.data.prefetch import Prefetch
from jaxgpt.data.tokenfiles import Tokens, global_batch, open_tokens, window_starts
from jaxgpt.train.loop import fit, prepare
from conftest import SHARED, require_module, require_shared

SETS = ["n_layer=1", "d_model=32", "d_ff=64", "batch_size=4", "seq_len=16", "eval_every=0", "eval_batches=2",
        "log_every=1"]


def write_nanogpt(out: Path, text: str) -> dict:
    """nanoGPT's data/shakespeare_char/prepare.py, as it writes its files."""
    out.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    train_ids = [stoi[c] for c in text[:int(n * 0.9)]]
    val_ids = [stoi[c] for c in text[int(n * 0.9):]]
    np.array(train_ids, dtype=np.uint16).tofile(out / "train.bin")
    np.array(val_ids, dtype=np.uint16).tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return {"chars": chars, "train": np.array(train_ids), "val": np.array(val_ids)}


@pytest.fixture(scope="module")
def shakespeare_char(tmp_path_factory):
    text = require_shared(SHARED / "data" / "tinyshakespeare.txt", "Tiny Shakespeare").read_text(encoding="utf-8")
    d = tmp_path_factory.mktemp("shakespeare_char")
    return d, text, write_nanogpt(d, text)


def train_args(data, out, *extra):
    return ["train", "--preset", "seed-minigpt", "--data", str(data), *[a for s in SETS for a in ("--set", s)],
            "--quiet", "--out", str(out), *extra]


def test_nanogpt_dir_opens_memory_mapped_with_its_vocabulary(shakespeare_char):
    d, text, ref = shakespeare_char
    td = open_tokens(d)
    assert td.layout == "nanogpt" and td.vocab_size == len(ref["chars"]) == 65
    assert td.tokenizer == {"kind": "char", "chars": ref["chars"]}
    assert isinstance(td.train.parts[0], np.memmap) and isinstance(td.val.parts[0], np.memmap)
    assert len(td.train) == len(ref["train"]) and len(td.val) == len(ref["val"])
    np.testing.assert_array_equal(td.train.read(1000, 500), ref["train"][1000:1500])
    starts = window_starts(len(td.train), 4, 16, 0, 7)
    x, y = global_batch(td.train, 4, 16, 0, 7)
    want = np.stack([ref["train"][s:s + 17] for s in starts])
    np.testing.assert_array_equal(x, want[:, :-1])
    np.testing.assert_array_equal(y, want[:, 1:])


@pytest.mark.e2e  # train, eval and sample through the command line: make test-slow
def test_train_eval_sample_on_nanogpt_shakespeare_char(shakespeare_char, tmp_path, capsys):
    d, text, ref = shakespeare_char
    run = tmp_path / "run"
    assert main(train_args(d, run, "--set", "steps=3", "--log", "tensorboard")) == 0
    out = capsys.readouterr().out
    assert f"lm on {d} | vocab 65" in out
    check_tensorboard(run)
    assert main(["sample", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20"]) == 0
    sample = capsys.readouterr().out.split("\n", 1)[1]
    assert sample.startswith("ROMEO:") and len(sample.rstrip("\n")) >= 26 and set(sample) <= set(ref["chars"]) | {"\n"}
    assert main(["eval", "--ckpt", str(run), "--json", str(tmp_path / "e.json")]) == 0
    assert "validation split, 2 batches" in capsys.readouterr().out
    assert 3.5 < json.loads((tmp_path / "e.json").read_text())["val_loss"] < 4.6  # ~ln 65 after 3 steps


def check_tensorboard(run: Path) -> None:
    """`--log tensorboard` wrote event files (by hand: tensorboardX would import torch) that hold
    metrics.jsonl's rows; read back with tensorboardX's own Event proto and CRC-32C."""
    require_module("tensorboardX")
    import struct

    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    (path,) = (run / "tensorboard").glob("events.out.tfevents.*")
    raw, events = path.read_bytes(), []
    masked = lambda b: (((crc32c(b) >> 15) | (crc32c(b) << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    while raw:
        (n,), head = struct.unpack("<Q", raw[:8]), raw[:8]
        assert struct.unpack("<I", raw[8:12])[0] == masked(head)
        data = raw[12:12 + n]
        assert struct.unpack("<I", raw[12 + n:16 + n])[0] == masked(data)
        events.append(Event.FromString(data))
        raw = raw[16 + n:]
    assert events[0].file_version == "brain.Event:2"
    got = {(e.step, v.tag): v.simple_value for e in events[1:] for v in e.summary.value}
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    want = {(r["step"], f"{'val' if 'val_loss' in r else 'train'}/{k}"): v for r in rows for k, v in r.items() if k != "step"}
    assert got.keys() == want.keys() and ("train/loss" in {t for _, t in got})
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k  # float32 in the event file


def _bad_dirs(tmp: Path) -> dict:
    """name -> (directory, extra CLI args, the part of the one-line error that names the problem)."""
    good = np.arange(200, dtype=np.uint16) % 10
    cases = {}

    def make(name, meta=None, train=good, val=good, pkl=None):
        d = tmp / name
        d.mkdir()
        if meta is not None:
            (d / "meta.json").write_text(json.dumps(meta))
        if pkl is not None:
            with open(d / "meta.pkl", "wb") as f:
                pickle.dump(pkl, f)
        if train is not None:
            (d / "train.bin").write_bytes(train if isinstance(train, bytes) else train.tobytes())
        if val is not None:
            (d / "val.bin").write_bytes(val if isinstance(val, bytes) else val.tobytes())
        return d

    meta = {"vocab_size": 10, "dtype": "uint16", "tokenizer": None}
    cases["missing train.bin"] = (make("no_train", meta, train=None), [], "has no train.bin")
    cases["odd size"] = (make("odd", meta, train=good.tobytes() + b"\0"), [], "not a multiple of 2 (uint16)")
    big = good.copy()
    big[150] = 10
    cases["id >= vocab"] = (make("big_id", meta, train=big), [], "token id 10 at position 150 is outside the vocabulary [0, 10)")
    cases["dtype too small"] = (make("dtype", {**meta, "vocab_size": 70000}), [], "vocab_size=70000 does not fit dtype uint16")
    cases["empty val.bin"] = (make("empty_val", meta, val=b""), [], "val.bin' is empty, but evaluation needs")
    cases["missing val.bin"] = (make("no_val", meta, val=None), [], "val.bin' is missing, but evaluation needs")
    cases["vocab_size too small"] = (make("vocab", pkl={"vocab_size": 10}), ["--set", "vocab_size=8"],
                                     "--set vocab_size=8 is smaller than")  # a larger one pads the vocabulary
    return cases


def test_bad_token_dirs_are_one_line_and_exit_2(tmp_path, capsys):
    for name, (d, extra, msg) in _bad_dirs(tmp_path).items():
        rc = main(train_args(d, tmp_path / f"run-{d.name}", *extra))
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert err.count("\n") == 1 and err.startswith("jaxgpt train: error: ") and msg in err, (name, err)
        assert not (tmp_path / f"run-{d.name}" / "checkpoints").exists(), name  # nothing started, nothing lost


def test_sampled_check_misses_what_the_full_check_and_the_batches_catch(tmp_path, capsys):
    """A bad id off the sampled runs passes the open-time check and fails --check-data (a batch
    that reads it fails fit's host-side check_batch, as every batch does)."""
    d = tmp_path / "big"
    d.mkdir()
    ids = np.arange(64 * 32768 * 2, dtype=np.uint16) % 10
    ids[40_000] = 11  # between two sampled runs
    ids.tofile(d / "train.bin")
    ids[:1000].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 10, "dtype": "uint16", "tokenizer": None}))
    assert open_tokens(d).vocab_size == 10
    with pytest.raises(ValueError, match=r"token id 11 at position 40000 .*\(checked in full\)"):
        open_tokens(d, check="full")
    assert main(train_args(d, tmp_path / "run", "--check-data")) == 2
    assert "token id 11 at position 40000" in capsys.readouterr().err


def test_each_process_reads_only_its_rows_of_the_global_batch(shakespeare_char):
    """Self-consistency: rows read apart (as two processes would) equal the global batch."""
    d, _, _ = shakespeare_char
    td = open_tokens(d)
    full = global_batch(td.train, 8, 16, 3, 11)
    before = td.train.reads
    halves = [global_batch(td.train, 8, 16, 3, 11, rows=r) for r in (range(0, 4), range(4, 8))]
    assert td.train.reads - before == 8  # each row read once, by its owner
    for i in range(2):
        np.testing.assert_array_equal(halves[0][i][:4], full[i][:4])
        np.testing.assert_array_equal(halves[1][i][4:], full[i][4:])
        assert not halves[0][i][4:].any() and not halves[1][i][:4].any()


def test_shards_read_as_one_stream(tmp_path):
    ids = np.arange(1000, dtype=np.uint32)
    paths = []
    for i, (a, b) in enumerate([(0, 300), (300, 300), (300, 1000)]):  # an empty shard in the middle
        paths.append(tmp_path / f"s{i}.bin")
        ids[a:b].tofile(paths[-1])
    t = Tokens(paths, "uint32")
    assert len(t) == 1000
    np.testing.assert_array_equal(t.windows(np.array([0, 290, 995 - 5]), 10), np.stack([ids[s:s + 10] for s in (0, 290, 990)]))


def test_prefetch_keeps_order_and_raises_at_the_failing_step():
    calls = []

    def fn(s):
        calls.append(s)
        if s == 4:
            raise KeyboardInterrupt
        return s * s

    with Prefetch(fn, range(2, 10), depth=2) as p:
        assert [p.get(s) for s in (2, 3)] == [4, 9]
        with pytest.raises(KeyboardInterrupt):
            p.get(4)
    assert calls == [2, 3, 4]  # nothing built after the failure


@pytest.mark.e2e  # two training runs through the command line: make test-slow
def test_token_file_run_resumes_bit_exact(shakespeare_char, tmp_path):
    """Stopped after 3 of 6 updates (checkpoint on the stop) and resumed in a fresh prepare: the
    losses and the final weights equal an uninterrupted run's bit for bit."""
    d, _, _ = shakespeare_char
    config, tc = apply_sets(get_preset("seed-minigpt"), SETS + ["steps=6", "ckpt_every=0", "dropout=0.1"])
    runs = {}
    for name, until in (("ref", None), ("run", 3), ("run", None)):
        c, t, task, state = prepare(tmp_path / name, config, tc, data=str(d))
        runs[name] = fit(c, t, task, tmp_path / name, state=state, progress=False, until=until)
    assert runs["run"]["state"].step == 6
    ref = {r["step"]: r["loss"] for r in runs["ref"]["history"] if "loss" in r}
    got = {r["step"]: r["loss"] for r in runs["run"]["history"] if "loss" in r}
    assert got == ref and sorted(got) == [1, 2, 3, 4, 5, 6]
    for a, b in zip(jax.tree.leaves(runs["run"]["state"].params), jax.tree.leaves(runs["ref"]["state"].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



def test_bare_nanogpt_gpt2_files_take_the_models_vocabulary(tmp_path):
    """nanoGPT's openwebtext/prepare.py writes no meta.pkl: GPT-2 ids, the vocabulary is the model's
    (the task then has an id-only tokenizer: sampling needs --prompt-ids and prints ids)."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.token_task import token_task

    ids = np.random.default_rng(0).integers(0, 50257, 5000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    ids[:500].tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match="has no meta.json or meta.pkl: give the vocabulary size"):
        open_tokens(tmp_path)
    task = token_task(str(tmp_path), TrainConfig(batch_size=2, seq_len=16), vocab_size=50257)
    assert task.tokenizer.to_dict() == {"kind": "ids", "vocab_size": 50257}
    assert task.tokenizer.decode([5, 50256]) == "5,50256"
    with pytest.raises(ValueError, match="token id 50256 .* outside the vocabulary \\[0, 50000\\)"):
        ids[100] = 50256
        ids.tofile(tmp_path / "train.bin")
        open_tokens(tmp_path, vocab_size=50000)
