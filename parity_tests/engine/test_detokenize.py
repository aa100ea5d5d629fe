"""Incremental detokenization (jaxgpt/inference/detokenize.py).

Reference: the tokenizer's own decode of the whole id list (``tokenizers``' byte-level BPE trained
here on text with emoji and CJK, a SentencePiece-like BPE (Metaspace, byte fallback, skipped
special tokens) and jaxgpt's character vocabulary); the streamed deltas must
concatenate to exactly that text, cut before the first stop string when one is given. The O(n)
claim is measured by counting the ids handed to ``decode``.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxgpt.data.tokenizers import CharTokenizer, train_bpe
from jaxgpt.inference.detokenize import Detokenizer

TEXT = ("the cat sat on the mat 🐈🐈‍⬛. 猫坐在垫子上。 the dog 🐕 met the cat, naïve café — ok?\n"
        "数据 and 模型 🤖🚀 emoji ✨ mixed with text 😀😃 then more 漢字 and ascii.\n") * 8


@pytest.fixture(scope="module")
def bpe():
    # a small vocabulary: many tokens are parts of a multi-byte character
    return train_bpe(TEXT, 300, special_tokens=("<|endoftext|>",))


@pytest.fixture(scope="module")
def char():
    return CharTokenizer.from_text(TEXT)


class _SentencePieceLike:
    """LLaMA-style: Metaspace words, byte fallback, the first leading space stripped by the decoder,
    special tokens skipped. A window whose context decodes to nothing would lose a space."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]  # skipped when decoding
        tok.train_from_iterator(TEXT.splitlines(), trainer=trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, show_progress=False))
        self.tok, self.vocab_size = tok, tok.get_vocab_size()

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode(list(ids))


@pytest.fixture(scope="module")
def spm():
    return _SentencePieceLike()


def _chunks(ids, rng):
    """ids split into random pieces of 1..4 (a speculative round emits several at once)."""
    out, i = [], 0
    while i < len(ids):
        n = int(rng.integers(1, 5))
        out.append(ids[i:i + n])
        i += n
    return out


def _stream(tok, ids, rng, stop=()):
    d = Detokenizer(tok, stop)
    pieces = _chunks(list(ids), rng)
    deltas = [d.add(p, final=j == len(pieces) - 1) for j, p in enumerate(pieces)]
    return deltas, d


def _expected(full, stop):
    cuts = [full.find(s) for s in stop if full.find(s) >= 0]
    return full[:min(cuts)] if cuts else full


@pytest.mark.parametrize("kind", ["bpe", "char", "spm"])
def test_deltas_concatenate_to_the_full_decode_on_random_id_streams(kind, bpe, char, spm):
    tok = {"bpe": bpe, "char": char, "spm": spm}[kind]
    rng = np.random.default_rng(0)
    text_ids = list(tok.encode(TEXT))
    for trial in range(60):
        if trial % 2:  # random ids: invalid UTF-8 byte runs (BPE), skipped special tokens (spm)
            ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 80))).tolist()
        else:  # a slice of real text, starting anywhere (perhaps inside a character)
            a = int(rng.integers(0, len(text_ids) - 100))
            ids = text_ids[a:a + int(rng.integers(1, 100))]
        full = tok.decode(ids)
        deltas, d = _stream(tok, ids, rng)
        assert "".join(deltas) == full, (kind, trial, ids)
        assert Detokenizer(tok).add(ids, final=True) == full  # all at once
        assert d.ids == ids and not d.stopped


def test_a_partial_character_is_held_until_it_completes(bpe):
    ids = list(bpe.encode("ab🐈cd猫"))
    full = bpe.decode(ids)
    d = Detokenizer(bpe)
    sent = ""
    for i in ids:
        sent += d.add([i])
        assert "\ufffd" not in sent and full.startswith(sent)  # never a half character, always a prefix
    sent += d.add([], final=True)
    assert sent == full == "ab🐈cd猫"
    split = [i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith("\ufffd")]
    assert split, "the test needs a character split over tokens: retrain the tokenizer smaller"


@pytest.mark.parametrize("kind", ["bpe", "char", "spm"])
def test_stop_strings_cut_the_text_even_across_tokens(kind, bpe, char, spm):
    tok = {"bpe": bpe, "char": char, "spm": spm}[kind]
    rng = np.random.default_rng(1)
    text_ids = list(tok.encode(TEXT))
    spanning = 0
    for trial in range(60):
        a = int(rng.integers(0, len(text_ids) - 120))
        ids = text_ids[a:a + int(rng.integers(20, 120))]
        full = tok.decode(ids)
        s0 = int(rng.integers(0, len(full) - 6))
        stop = (full[s0:s0 + int(rng.integers(1, 6))].replace("\ufffd", "") or "zz", "never-seen-stop")
        deltas, d = _stream(tok, ids, rng, stop)
        want = _expected(full, stop)
        assert "".join(deltas) == want, (kind, trial, stop)
        assert Detokenizer(tok, stop).add(ids, final=True) == want  # all at once
        assert d.stopped == any(s in full for s in stop)
        for k in range(1, len(deltas)):  # no delta ever shows the start of the stop string early
            assert want.startswith("".join(deltas[:k]))
        at = full.find(stop[0])
        ends = {len(tok.decode(ids[:i + 1])) for i in range(len(ids))}  # where tokens end in the text
        spanning += any(at < e < at + len(stop[0]) for e in ends)
    assert spanning >= 5, "few stop strings spanned a token boundary: the test proves less than it says"


def test_text_after_a_stop_is_not_returned(char):
    d = Detokenizer(char, stop=("cat",))
    ids = list(char.encode("the cat sat"))
    assert d.add(ids[:5]) == "the "  # 'c' may start 'cat': held back
    assert d.add(ids[5:7]) == "" and d.stopped
    assert d.add(ids[7:], final=True) == ""
    assert d.ids == ids


def test_no_tokenizer_records_ids_only():
    d = Detokenizer(None, stop=("x",))
    assert d.add([1, 2, 3], final=True) == "" and d.ids == [1, 2, 3]


class _Counting:
    """The tokenizer, counting the ids each decode call is handed: the detokenization work."""

    def __init__(self, tok):
        self.tok, self.ids = tok, 0

    def decode(self, ids):
        self.ids += len(ids)
        return self.tok.decode(ids)


@pytest.mark.parametrize("kind", ["bpe", "char", "spm"])
def test_streaming_1000_tokens_costs_constant_work_per_token(kind, bpe, char, spm):
    tok = {"bpe": bpe, "char": char, "spm": spm}[kind]
    ids = (list(tok.encode(TEXT)) * 10)[:1000]
    counting = _Counting(tok)
    d = Detokenizer(counting, stop=("never-seen-stop", "🐈 and"))
    cost = []
    for i in ids:
        before = counting.ids
        d.add([i])
        cost.append(counting.ids - before)
    first, last = sum(cost[:100]), sum(cost[-100:])
    # a full decode per token would cost ~10x more in the last 100 tokens than in the first 100
    assert last <= 1.2 * first, (first, last)
    assert max(cost) <= 40, max(cost)  # a window of a few tokens, whatever the position
    assert len(d.ids) == 1000 and not d.stopped
