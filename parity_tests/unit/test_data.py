"""jaxgpt.data: tokenizers, built-in corpora and batching, checked against the seeds' own code.

Seed snippets are read from ../shared/seeds at test time and executed, so "matches the seed"
means the seed's code, not a transcription of it; those tests skip when the folder is missing
(and fail when CI=true: conftest.require_shared).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED, require_module, require_shared
from jaxgpt import data as D
from jaxgpt.data import corpora

ROOT = Path(__file__).resolve().parents[2]
SEEDS = SHARED / "seeds"


def seed_source(name: str) -> str:
    path = require_shared(SEEDS / name, "seed file")  # skips, or fails under CI=true
    return path.read_text(encoding="utf-8")


def between(src: str, start: str, end: str) -> str:
    i = src.index(start)
    return src[i:src.index(end, i)]


@pytest.fixture(scope="module")
def seed002():
    """Seed 002's 50 PAIRS and its CharTokenizer class, executed from the seed text."""
    src = seed_source("002_cf3e92bca7241f9e.txt")
    end = src.index("assert len(PAIRS) == 50")  # an earlier, 10-pair PAIRS excerpt also exists
    ns: dict = {}
    exec(src[src.rindex("\nPAIRS = [", 0, end):end], ns)
    exec(re.search(r"^class CharTokenizer:.*?(?=^# ═)", src, re.S | re.M).group(0), ns)
    assert len(ns["PAIRS"]) == 50
    ns["src"] = src
    return ns


def global_np_state_fingerprint():
    return np.random.get_state()[1][:8].copy(), np.random.get_state()[2]


# ------------------------------------------------------------------------------------------ imports

def test_data_module_does_not_import_torch():
    code = "import sys, jaxgpt.data; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_pyproject_ships_the_corpus_files():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["package-data"]["jaxgpt.data"]
    shipped = [p for pat in patterns for p in (ROOT / "jaxgpt" / "data").glob(pat)]
    assert ROOT / "jaxgpt" / "data" / "corpora" / "zh_en_pairs.tsv" in shipped


# ------------------------------------------------------------------------------------------ CharTokenizer

def test_char_tokenizer_round_trip_and_order():
    text = "hello world, 你好!\n"
    tok = D.CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tok.decode(ids) == text and tok.decode(ids.tolist()) == text
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""


def test_char_tokenizer_unknown_characters_raise_with_positions():
    tok = D.CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"2 character\(s\).*'x' at position 1, 'y' at position 3"):
        tok.encode("axby")
    with pytest.raises(ValueError, match=r"id 3 at position 1 is outside the vocabulary \[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="empty text"):
        D.CharTokenizer.from_text("")
    with pytest.raises(ValueError, match="duplicate"):
        D.CharTokenizer(["a", "a"])


def test_char_tokenizer_matches_seed003_vocabulary():
    src = seed_source("003_23a6c5c701fd446e.txt")
    ns = {"text": "To be or not to be, that is the question. " * 1000}  # the seed's offline text
    vocab_code = between(src, "    chars = sorted(list(set(text)))", '    print(f"词表大小')
    exec(textwrap.dedent(vocab_code), ns)
    tok = D.CharTokenizer.from_text(ns["text"])
    assert tok.vocab_size == ns["vocab_size"]
    sample = "that is the question"
    assert tok.encode(sample).tolist() == ns["encode"](sample)
    assert tok.decode(ns["encode"](sample)) == ns["decode"](ns["encode"](sample))


# ------------------------------------------------------------------------------------------ corpora

def synthetic_by_recipe() -> str:
    """Seed 000's recipe on numpy's global RNG, leaving the global state as it was."""
    saved = np.random.get_state()
    try:
        np.random.seed(42)
        text = ("abcdefg" * 5 + " ") * 200 + ("0123456789" * 3 + " ") * 200
        sentences = corpora._SYNTHETIC_SENTENCES
        return text + "".join(sentences[np.random.randint(len(sentences))] for _ in range(500))
    finally:
        np.random.set_state(saved)


def test_seed_synthetic_corpus_matches_global_rng_recipe():
    before = global_np_state_fingerprint()
    text = D.builtin_corpus("seed-synthetic")
    after = global_np_state_fingerprint()
    assert np.array_equal(before[0], after[0]) and before[1] == after[1], "touched the global RNG"
    assert len(text) == 25752
    assert text.startswith("abcdefg" * 5 + " abcdefg") and text[7200:7231] == "0123456789" * 3 + " "
    assert text[13400:].startswith("the sun is bright today ")  # first RandomState(42).randint(5) == 3
    assert text == synthetic_by_recipe()


def test_seed_synthetic_corpus_matches_seed000_code():
    src = seed_source("000_6dcef6f80709a6ad.txt")
    snippet = between(src, 'train_text = ""', "\n# 编码")  # corpus and its char vocabulary
    saved = np.random.get_state()
    try:
        np.random.seed(42)  # the seed's set_seed(42) runs just before this cell
        ns = {"np": np}
        exec(snippet, ns)
    finally:
        np.random.set_state(saved)
    text = D.builtin_corpus("seed-synthetic")
    assert text == ns["train_text"]
    tok = D.CharTokenizer.from_text(text)
    assert tok.vocab_size == ns["vocab_size"] and tok.chars == ns["chars"]
    assert tok.encode(text[:200]).tolist() == [ns["char_to_idx"][c] for c in text[:200]]


def test_unknown_corpus_names_list_the_available_ones():
    with pytest.raises(ValueError, match=r"'nope'.*seed-synthetic.*zh-en"):
        D.builtin_corpus("nope")
    with pytest.raises(ValueError, match=r"'seed-synthetic'.*zh-en"):
        D.builtin_pairs("seed-synthetic")


def test_builtin_pairs_are_the_seed002_pairs(seed002):
    pairs = D.builtin_pairs("zh-en")
    assert pairs == [tuple(p) for p in seed002["PAIRS"]]
    assert D.builtin_corpus("zh-en").splitlines()[1] == "谢谢\tthank you"


# ------------------------------------------------------------------------------------------ PairTokenizer

def test_pair_tokenizer_vocabulary_is_seed002s_147(seed002):
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    ref = seed002["CharTokenizer"](seed002["PAIRS"])
    assert tok.vocab_size == 147
    assert tok.vocab == ref.vocab
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id) == (ref.PAD, ref.BOS, ref.EOS, ref.SEP)


@pytest.mark.parametrize("max_len", [40, 25, 12, 5])
def test_encode_pair_matches_seed002(seed002, max_len):
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    ref = seed002["CharTokenizer"](seed002["PAIRS"])
    for zh, en in seed002["PAIRS"]:
        ids = tok.encode_pair(zh, en, max_len, truncate=True)
        assert ids.dtype == np.int32 and ids.tolist() == ref.encode(zh, en, max_len)
        assert tok.decode_en(ids) == ref.decode_en(ids.tolist())
        if max_len == 40:  # the longest pair fills exactly 40, so nothing is cut
            assert tok.decode_en(ids) == en


def test_encode_pairs_matches_seed002_translation_dataset(seed002):
    torch = require_module("torch")
    ns = dict(seed002, torch=torch)
    exec(re.search(r"^class TranslationDataset\(.*?(?=^# ═)", seed002["src"], re.S | re.M).group(0), ns)
    ref = ns["TranslationDataset"](seed002["PAIRS"], seed002["CharTokenizer"](seed002["PAIRS"]), 40)
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    x, y = D.encode_pairs(tok, D.builtin_pairs(), 40)
    assert x.shape == y.shape == (50, 39) and x.dtype == y.dtype == np.int32
    for i in range(50):
        rx, ry = ref[i]
        assert x[i].tolist() == rx.tolist() and y[i].tolist() == ry.tolist()


def test_encode_pairs_ignore_index_only_replaces_padding():
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    x0, y0 = D.encode_pairs(tok, D.builtin_pairs(), 40)
    x1, y1 = D.encode_pairs(tok, D.builtin_pairs(), 40, target_pad=D.IGNORE_INDEX)
    assert np.array_equal(x0, x1)
    pad = y0 == tok.pad_id
    assert pad.any() and np.all(y1[pad] == -100) and np.array_equal(y1[~pad], y0[~pad])


def test_decode_en_matches_seed002_on_arbitrary_ids(seed002):
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    ref = seed002["CharTokenizer"](seed002["PAIRS"])
    rng = np.random.default_rng(0)
    for _ in range(300):  # specials are frequent so every branch (repeat <sep>, <bos>, ...) runs
        ids = np.where(rng.random(20) < 0.3, rng.integers(0, 4, 20), rng.integers(0, 147, 20))
        assert tok.decode_en(ids) == ref.decode_en(ids.tolist())


def test_pair_tokenizer_refuses_what_the_seed_silently_altered():
    tok = D.PairTokenizer.from_pairs(D.builtin_pairs())
    with pytest.raises(ValueError, match=r"en 'hello!'.*'!' at position 5"):
        tok.encode_pair("你好", "hello!")  # the seed would encode '!' as <pad>
    with pytest.raises(ValueError, match=r"needs 10 tokens but max_len=9"):
        tok.encode_pair("你好", "hello", 9)  # the seed would drop <eos> without a word
    with pytest.raises(ValueError, match=r"id 147 .* \[0, 147\)"):
        tok.decode_en([3, 147])
    prompt = tok.prompt("你好")
    assert prompt.tolist() == tok.encode_pair("你好", "hello")[:4].tolist() and prompt[-1] == tok.sep_id


# ------------------------------------------------------------------------------------------ serialization

def test_tokenizer_dicts_round_trip_through_json():
    char = D.CharTokenizer.from_text("abc xyz")
    pair = D.PairTokenizer.from_pairs(D.builtin_pairs())
    from jaxgpt.data.tokenizers import IdTokenizer  # token files without a tokenizer

    for tok in (char, pair, IdTokenizer(50257)):
        back = D.tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
        assert type(back) is type(tok) and back.to_dict() == tok.to_dict()
    assert D.tokenizer_from_dict(char.to_dict()).encode("zyx").tolist() == [6, 5, 4]
    with pytest.raises(ValueError, match=r"kind 'word'.*\('char', 'pair', 'bpe', 'ids'\)"):
        D.tokenizer_from_dict({"kind": "word"})
    with pytest.raises(ValueError, match=r"kind 'pair', got kind='char'"):
        D.PairTokenizer.from_dict(char.to_dict())


# ------------------------------------------------------------------------------------------ LM batches

def test_load_text(tmp_path):
    (tmp_path / "t.txt").write_text("héllo 你好\n", encoding="utf-8")
    assert D.load_text(tmp_path / "t.txt") == "héllo 你好\n"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        D.load_text(tmp_path / "missing.txt")


def test_split_train_val_is_seed003s_contiguous_90_10():
    ids = np.arange(1000)
    train, val = D.split_train_val(ids)
    assert len(train) == 900 and len(val) == 100 and np.array_equal(np.concatenate([train, val]), ids)
    for n in range(10, 3000, 7):
        assert len(D.split_train_val(np.arange(n))[0]) == int(0.9 * n)  # the seed's n
    assert len(D.split_train_val(ids, 0.25)[1]) == 250
    with pytest.raises(ValueError, match=r"in \[0, 1\), got 1.0"):
        D.split_train_val(ids, 1.0)
    with pytest.raises(ValueError, match="3 tokens into 0 train and 3 val"):
        D.split_train_val(np.arange(3), 0.8)
    with pytest.raises(ValueError, match="5 tokens into 5 train and 0 val"):
        D.split_train_val(np.arange(5), 1e-17)  # 1 - 1e-17 rounds to 1.0
    train, val = D.split_train_val(ids, 0.0)  # val_fraction=0: train on everything
    assert len(train) == 1000 and len(val) == 0


def test_get_batch_windows_shift_and_dtype():
    data = np.arange(500, dtype=np.int64)
    x, y = D.get_batch(data, 16, 32, seed=3, step=0)
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x - x[:, :1], np.broadcast_to(np.arange(32), (16, 32)))  # contiguous
    assert np.array_equal(y, x + 1)  # targets are the next tokens
    assert x[:, 0].min() >= 0 and y[:, -1].max() <= 499
    x, y = D.get_batch(np.arange(9), 4, 8, seed=0, step=0)  # one window fits exactly
    assert np.array_equal(x[0], np.arange(8)) and np.array_equal(y[0], np.arange(1, 9))


def test_get_batch_is_a_pure_function_of_seed_and_step():
    data = np.random.default_rng(0).integers(0, 50, 2000)
    before = global_np_state_fingerprint()
    run = [D.get_batch(data, 8, 16, seed=7, step=s) for s in range(6)]
    resumed = [D.get_batch(data, 8, 16, seed=7, step=s) for s in (5, 4, 3)]  # any order
    for s, (x, y) in zip((5, 4, 3), resumed):
        assert np.array_equal(x, run[s][0]) and np.array_equal(y, run[s][1])
    assert not np.array_equal(run[0][0], run[1][0])
    assert not np.array_equal(run[0][0], D.get_batch(data, 8, 16, seed=8, step=0)[0])
    assert np.array_equal(before[0], global_np_state_fingerprint()[0])


def test_get_batch_validates():
    with pytest.raises(ValueError, match=r"data has 8 tokens; seq_len=8 needs at least 9"):
        D.get_batch(np.arange(8), 2, 8, 0, 0)
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got -1"):
        D.get_batch(np.arange(100), 2, 8, 0, -1)
    with pytest.raises(ValueError, match="1-D integer"):
        D.get_batch(np.zeros(100), 2, 8, 0, 0)


# ----------------------------------------------------------------------------- fixed-length batches

def test_pad_batch_masks_and_truncation():
    ids, mask = D.pad_batch([[5, 6, 7], [], [1, 2, 3, 4]], max_len=4, pad_id=0)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape == (3, 4)
    assert ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0], [1, 2, 3, 4]]
    assert mask.tolist() == [[True, True, True, False], [False] * 4, [True] * 4]
    with pytest.raises(ValueError, match=r"sequence 1 has 5 tokens but max_len=4"):
        D.pad_batch([[1], [1, 2, 3, 4, 5]], 4, 0)
    ids, mask = D.pad_batch([[1, 2, 3, 4, 5]], 4, 9, truncate=True)
    assert ids.tolist() == [[1, 2, 3, 4]] and mask.all()
    assert D.pad_batch([[1]], 3, 9)[0].tolist() == [[1, 9, 9]]


def test_shuffled_batch_covers_each_epoch_once_and_is_deterministic():
    x = np.arange(50) * 10
    y = np.arange(50)
    per_epoch = 50 // 8  # 6 batches, 2 rows dropped per epoch
    seen = [D.shuffled_batch((x, y), 8, seed=1, step=s) for s in range(2 * per_epoch)]
    for bx, by in seen:
        assert bx.shape == by.shape == (8,) and np.array_equal(bx, by * 10)  # rows stay aligned
    epoch0 = np.concatenate([b[1] for b in seen[:per_epoch]])
    epoch1 = np.concatenate([b[1] for b in seen[per_epoch:]])
    assert len(set(epoch0)) == 48 and len(set(epoch1)) == 48 and not np.array_equal(epoch0, epoch1)
    again = D.shuffled_batch((x, y), 8, seed=1, step=7)
    assert np.array_equal(again[0], seen[7][0])
    with pytest.raises(ValueError, match=r"batch_size=51 is larger than the 50 rows"):
        D.shuffled_batch((x, y), 51, 0, 0)
    with pytest.raises(ValueError, match=r"\[50, 49\]"):
        D.shuffled_batch((x, y[:-1]), 8, 0, 0)


# ------------------------------------------------------------------------------------------ BPE

def test_bpe_trains_fast_and_round_trips(tmp_path):
    text = D.builtin_corpus("seed-synthetic") + D.builtin_corpus("zh-en")
    start = time.perf_counter()
    tok = D.train_bpe(text, 320)
    assert time.perf_counter() - start < 5.0
    assert 256 < tok.vocab_size <= 320
    sample = "the cat sat on the mat\n我想去北京\ttabs & ünïcode never seen: ☃"
    ids = tok.encode(sample)
    assert ids.dtype == np.int32 and tok.decode(ids) == sample
    assert len(tok.encode("the cat sat on the mat")) < len("the cat sat on the mat")  # merges learned
    back = D.tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert isinstance(back, D.BPETokenizer) and back.encode(sample).tolist() == ids.tolist()
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    from_path = D.train_bpe(tmp_path / "corpus.txt", 320)
    assert from_path.encode(sample).tolist() == ids.tolist()


def test_bpe_validates():
    with pytest.raises(ValueError, match=r"vocab_size=100 is below 257 \(256 bytes \+ 1 special"):
        D.train_bpe("abc abc", 100, special_tokens=["<eot>"])
    with pytest.raises(ValueError, match="non-empty"):
        D.train_bpe("", 300)
    tok = D.train_bpe("abc abc abc", 300)
    with pytest.raises(ValueError, match=rf"id {tok.vocab_size} at position 0"):
        tok.decode([tok.vocab_size])
