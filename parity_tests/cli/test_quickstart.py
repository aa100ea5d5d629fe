"""The quickstart's two commands on a small corpus with default flags: ``jaxgpt prepare corpus.txt d``
then ``jaxgpt train --data d``. One 100 KB text file is one document, so the document split of
``--val-fraction`` holds out nothing; prepare tops val.bin up from the end of the training stream
(``--min-val-tokens``) and train evaluates on it (it exited 2 on an empty val.bin before)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxgpt.cli import main
from jaxgpt.config import TrainConfig
from jaxgpt.data.prepare import MIN_VAL_TOKENS
from jaxgpt.data.tokenfiles import open_tokens
from conftest import SHARED, require_shared


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = require_shared(SHARED / "data" / "tinyshakespeare.txt", "Tiny Shakespeare").read_bytes()[:100_000]
    path = tmp_path_factory.mktemp("quick") / "corpus.txt"
    path.write_bytes(text)
    return path


@pytest.fixture(scope="module")
def prepared(corpus):
    out = corpus.parent / "d"
    assert main(["prepare", str(corpus), str(out), "--quiet"]) == 0  # default flags
    return out


def test_prepare_gives_a_small_corpus_a_validation_split(prepared, corpus):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["documents"] == {"train": 1, "val": 0}  # the document split held nothing out
    assert meta["tokens"] == {"train": 100_001 - MIN_VAL_TOKENS, "val": MIN_VAL_TOKENS}  # 100,000 chars + EOS
    assert meta["val_tail_tokens"] == MIN_VAL_TOKENS
    d = open_tokens(prepared, check="full")
    # the stream is unchanged, only cut in two: train.bin + val.bin decode back to the corpus
    ids = np.concatenate([d.train.read(0, len(d.train)), d.val.read(0, len(d.val))])
    from jaxgpt.data import tokenizer_from_dict

    assert tokenizer_from_dict(d.tokenizer).decode(ids[:-1]) == corpus.read_text()
    assert ids[-1] == d.eos_id


def test_default_train_config_finds_its_validation_windows(prepared):
    from jaxgpt.data.token_task import token_task

    task = token_task(str(prepared), TrainConfig())  # val_fraction=0.1 > 0: evaluation needs val.bin
    assert len(task.val[0]) == MIN_VAL_TOKENS and len(task.eval_batches(TrainConfig())) == 10


def test_min_val_tokens_zero_and_val_fraction_zero_hold_out_nothing(corpus, tmp_path, capsys):
    for flags in (["--min-val-tokens", "0"], ["--val-fraction", "0"]):
        out = tmp_path / flags[0].strip("-")
        assert main(["prepare", str(corpus), str(out), "--quiet", *flags]) == 0
        assert json.loads((out / "meta.json").read_text())["tokens"]["val"] == 0
    assert "warning: no document was held out" in capsys.readouterr().out  # the first one only says so


@pytest.mark.e2e  # a whole jaxgpt train run (compiles a train and an eval program)
def test_prepare_then_train_with_default_flags(prepared, tmp_path, capsys):
    # --preset and --out are required; steps keeps the run short; every data and validation flag is default
    assert main(["train", "--preset", "seed-minigpt", "--data", str(prepared), "--out", str(tmp_path / "run"),
                 "--set", "steps=2", "--quiet"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("done:") and "val loss none" not in line
    evals = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r and np.isfinite(r["val_loss"]) for r in evals)
