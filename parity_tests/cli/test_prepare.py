"""`jaxgpt prepare` round trips: documents in, token files out, and decoding train.bin / val.bin
gives back the documents joined by EOS (the reference is the documents as written here).

Tokenizers: the character tokenizer (EOS '\\x00', id 0) and an HF tokenizer.json (byte-level BPE
trained here with `tokenizers`, EOS <|endoftext|>). Sources: text files, .jsonl, a `datasets`
dataset saved with save_to_disk. No jax program is compiled here.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from jaxgpt.cli import main
from jaxgpt.data import tokenizer_from_dict, train_bpe
from jaxgpt.data.prepare import CHAR_EOS, prepare
from jaxgpt.data.tokenfiles import open_tokens
from conftest import require_module

DOCS = [f"Document {i}: the {'quick brown fox ' * (i % 5 + 1)}jumps\nover {i * 7} lazy dogs." for i in range(40)]
VAL = 0.1  # about 4 of the 40 documents held out (which: a fixed hash, jaxgpt.data.prepare.is_val); these
# tests check the document split itself, so min_val_tokens=0 (no top-up from the training stream)


def check_split(got: dict[str, list[str]], docs=DOCS) -> None:
    """train and val partition the documents, each in corpus order, and both are non-empty."""
    val = set(got["val"])
    assert 0 < len(val) < len(docs) // 2, got["val"]
    assert got["train"] == [d for d in docs if d not in val]
    assert got["val"] == [d for d in docs if d in val]


def decoded(out: Path) -> dict[str, list[str]]:
    td = open_tokens(out, check="full")
    tok = tokenizer_from_dict(td.tokenizer)
    result = {}
    for name, toks in (("train", td.train), ("val", td.val)):
        if len(toks) == 0:
            result[name] = []
            continue
        ids = toks.read(0, len(toks))
        assert ids[-1] == td.eos_id, name  # every document ends with EOS
        bounds = np.flatnonzero(ids == td.eos_id)
        pieces = np.split(ids, bounds + 1)[:-1]
        result[name] = [_decode(tok, p[:-1]) for p in pieces]
    return result


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False) if tok.kind == "hf" else tok.decode(ids)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(DOCS):
        (d / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def gpt2_like_tokenizer(tmp_path_factory):
    """A tokenizer.json like GPT-2's: byte-level BPE with <|endoftext|> (trained here, no download)."""
    require_module("tokenizers")
    tok = train_bpe("\n".join(DOCS), 300, special_tokens=["<|endoftext|>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.to_dict()["json"], encoding="utf-8")
    return path


def test_char_round_trip_from_text_files_with_nanogpt_meta(text_files, tmp_path):
    out = tmp_path / "char"
    assert main(["prepare", str(text_files / "*.txt"), str(out), "--tokenizer", "char", "--val-fraction", str(VAL), "--min-val-tokens", "0",
                 "--quiet"]) == 0
    got = decoded(out)
    check_split(got)
    train = got["train"]
    meta = json.loads((out / "meta.json").read_text())
    chars = sorted(set("".join(DOCS)) | {CHAR_EOS})
    assert meta["vocab_size"] == len(chars) and meta["dtype"] == "uint16" and meta["eos_id"] == 0
    assert meta["documents"] == {"train": len(train), "val": len(got["val"])}
    assert meta["tokens"]["train"] == sum(len(d) + 1 for d in train)
    with open(out / "meta.pkl", "rb") as f:  # nanoGPT's own metadata, readable by its train.py
        pkl = pickle.load(f)
    assert pkl["vocab_size"] == len(chars) and pkl["itos"][5] == chars[5] and pkl["stoi"][chars[7]] == 7
    assert not (out / ".shards").exists()


def test_tokenizer_json_round_trip_from_jsonl(gpt2_like_tokenizer, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)), encoding="utf-8")
    out = tmp_path / "bpe"
    prepare([str(src)], out, str(gpt2_like_tokenizer), text_field="body", val_fraction=VAL, min_val_tokens=0, progress=False, log=lambda _: None)
    got = decoded(out)
    check_split(got)
    train = got["train"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eos_token"] == "<|endoftext|>" and meta["tokenizer"]["kind"] == "hf"
    # an independent encoding: the tokenizers package on the same tokenizer.json
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(gpt2_like_tokenizer))
    want = np.concatenate([ref.encode(d).ids + [meta["eos_id"]] for d in train])
    np.testing.assert_array_equal(open_tokens(out).train.read(0, len(want) + 1), want)


def test_saved_datasets_dataset_round_trip(gpt2_like_tokenizer, tmp_path):
    datasets = require_module("datasets")
    saved = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(saved))
    out = tmp_path / "from_ds"
    prepare([str(saved)], out, str(gpt2_like_tokenizer), val_fraction=VAL, min_val_tokens=0, progress=False, log=lambda _: None)
    check_split(decoded(out))


def test_worker_processes_and_a_rerun_give_the_same_bytes(text_files, tmp_path, monkeypatch):
    """Two shards (FILES_PER_SHARD=16 of 40 files -> 3 shards), two workers: the same bytes as one
    process; kept shards are listed in meta.json, and a rerun encodes only the shard whose marker is gone."""
    import jaxgpt.data.prepare as prep

    monkeypatch.setattr(prep, "FILES_PER_SHARD", 16)
    src = [str(text_files / "*.txt")]
    one, two = tmp_path / "one", tmp_path / "two"
    prepare(src, one, "char", val_fraction=VAL, min_val_tokens=0, progress=False, log=lambda _: None)
    prepare(src, two, "char", val_fraction=VAL, min_val_tokens=0, num_proc=2, merge=False, progress=False, log=lambda _: None)
    meta = json.loads((two / "meta.json").read_text())
    assert meta["files"]["train"] == [f".shards/{i:05d}.train.bin" for i in range(3)]
    td1, td2 = open_tokens(one), open_tokens(two)
    np.testing.assert_array_equal(td1.train.read(0, len(td1.train)), td2.train.read(0, len(td2.train)))
    np.testing.assert_array_equal(td1.val.read(0, len(td1.val)), td2.val.read(0, len(td2.val)))
    shards = two / ".shards"
    kept = {p.name: p.stat().st_mtime_ns for p in shards.glob("0000[02].*.bin")}
    (shards / "00001.done").unlink()
    (shards / "00001.train.bin").write_bytes(b"")  # a half-written shard: redone
    prepare(src, two, "char", val_fraction=VAL, min_val_tokens=0, merge=False, progress=False, log=lambda _: None)
    assert {p.name: p.stat().st_mtime_ns for p in shards.glob("0000[02].*.bin")} == kept
    np.testing.assert_array_equal(open_tokens(two).train.read(0, len(td1.train)), td1.train.read(0, len(td1.train)))


def test_prepare_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    cases = [([str(tmp_path / "nothing*.txt"), str(tmp_path / "o1")], "no file matches"),
             ([str(tmp_path / "a.jsonl"), str(tmp_path / "o2")], "a.jsonl (the line at byte 14): no string field 'text'"),
             ([str(tmp_path / "a.jsonl"), str(tmp_path / "o3"), "--tokenizer", str(tmp_path / "none.json")],
              "not 'char', an HF directory or a tokenizer.json")]
    for args, msg in cases:
        assert main(["prepare", *args, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err


def test_a_jsonl_file_splits_into_byte_range_shards(tmp_path, monkeypatch):
    """64-byte shards of a jsonl file (cut inside lines): every line read once, by the shard it
    starts in, and two workers write the bytes one process writes."""
    import jaxgpt.data.prepare as prep

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    whole = tmp_path / "whole"
    prepare([str(src)], whole, "char", val_fraction=0, progress=False, log=lambda _: None)
    monkeypatch.setattr(prep, "JSONL_SHARD_BYTES", 64)
    assert len(prep.plan_shards([str(src)])) > len(DOCS)  # more shards than lines: some hold none
    cut = [tmp_path / "cut1", tmp_path / "cut2"]
    for n, out in zip((1, 2), cut):
        prepare([str(src)], out, "char", val_fraction=0, num_proc=n, progress=False, log=lambda _: None)
    assert decoded(cut[0])["train"] == DOCS
    ids = [open_tokens(d).train.read(0, 10**6) for d in (whole, *cut)]
    np.testing.assert_array_equal(ids[0], ids[1])
    np.testing.assert_array_equal(ids[1], ids[2])


@pytest.mark.parametrize("unit,tokenizer", [("line", "char"), ("paragraph", "char"), ("file", "char"),
                                            ("paragraph", "bpe"), ("file", "bpe")])
def test_a_large_text_file_splits_into_line_ranges_with_the_bytes_of_one(unit, tokenizer, gpt2_like_tokenizer,
                                                                         tmp_path, monkeypatch):
    """One text file over text_ranges.SHARD_BYTES (here 200 bytes): byte ranges cut on line (or
    paragraph) boundaries, encoded by two workers, give the token stream of reading it whole (shard
    bytes 10^9), document for document; a whole-file document under a subword tokenizer is not cut
    (tokens could merge across a cut), and the log says so."""
    import jaxgpt.data.prepare as prep
    from jaxgpt.data import text_ranges

    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(DOCS) + "\n", encoding="utf-8")  # paragraphs of 2 lines each
    spec = "char" if tokenizer == "char" else str(gpt2_like_tokenizer)
    runs, logs = {}, []
    for name, shard_bytes, n in (("whole", 10**9, 1), ("cut", 200, 2)):
        monkeypatch.setattr(text_ranges, "SHARD_BYTES", shard_bytes)
        runs[name] = tmp_path / name
        prepare([str(src)], runs[name], spec, text_unit=unit, val_fraction=0, min_val_tokens=0, num_proc=n,
                merge=False, progress=False, log=logs.append)
    meta = json.loads((runs["cut"] / "meta.json").read_text())
    cut = not (unit == "file" and tokenizer == "bpe")
    assert (len(meta["files"]["train"]) > 10) == cut, meta["files"]
    assert any("one worker reads it whole" in m for m in logs) == (not cut)
    assert meta["documents"] == json.loads((runs["whole"] / "meta.json").read_text())["documents"]
    ids = [open_tokens(runs[k]).train.read(0, 10**6) for k in ("whole", "cut")]
    np.testing.assert_array_equal(ids[0], ids[1])
    assert len(prep.plan_shards([str(src)], text_unit=unit, tokenizer=tokenizer, shard_bytes=200)) == \
        (-(-src.stat().st_size // 200) if cut else 1)
