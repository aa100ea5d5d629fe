"""Tokenizers (numpy only: no torch, no jax).

Three tokenizers share ``encode``/``decode``/``vocab_size``/``to_dict``/``from_dict``, and
``tokenizer_from_dict`` rebuilds any of them from the JSON-friendly dict stored in a checkpoint:

* ``CharTokenizer``: the plain sorted-character vocabulary of seeds 000 and 003.
* ``PairTokenizer``: seed 002's zh-en vocabulary, ``<pad> <bos> <eos> <sep>`` then characters.
* ``BPETokenizer``: byte-level BPE trained locally with the ``tokenizers`` package.
(``hf_tokenizer.HFTokenizer`` wraps an HF directory's tokenizer.json.)
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import numpy as np

from jaxgpt.core.validate import int_at_least as _int_at_least
from jaxgpt.data.corpora import load_text

SPACE = "\u2581"  # '▁': seed 002 writes English spaces as the SentencePiece word marker


def _lookup(text: str, table: dict[str, int], what: str) -> list[int]:
    ids = [table.get(c, -1) for c in text]
    bad = [(i, c) for i, (c, t) in enumerate(zip(text, ids)) if t < 0]
    if bad:
        shown = ", ".join(f"{c!r} at position {i}" for i, c in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"{what}: {len(bad)} character(s) not in the {len(table)}-entry "
                         f"vocabulary: {shown}{more}")
    return ids


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"ids must be a 1-D integer sequence, got shape {arr.shape} dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int64).tolist()


def _check_chars(chars: Sequence[str]) -> None:
    for c in chars:
        if not isinstance(c, str) or len(c) != 1:
            raise ValueError(f"vocabulary entries must be single characters, got {c!r}")
    if len(set(chars)) != len(chars):
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        raise ValueError(f"vocabulary has duplicate characters: {dupes!r}")


def _expect_kind(d: dict, kind: str) -> None:
    if d.get("kind") != kind:
        raise ValueError(f"expected a tokenizer dict of kind {kind!r}, got kind={d.get('kind')!r}")


class _OneList:
    """``to_dict`` / ``from_dict`` of a tokenizer that is its ``kind`` and one list (the attribute and
    constructor argument named ``_field``)."""

    kind: str
    _field: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, self._field: list(getattr(self, self._field))}

    @classmethod
    def from_dict(cls, d: dict):
        _expect_kind(d, cls.kind)
        return cls(d[cls._field])


class CharTokenizer(_OneList):
    """One id per character, ids in sorted character order (seeds 000 and 003)."""

    kind, _field = "char", "chars"

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("a CharTokenizer needs at least one character")
        _check_chars(chars)
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary is ``sorted(set(text))``."""
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """``text`` of T characters -> ids (T,) int32. Characters outside the vocabulary raise."""
        return np.asarray(_lookup(text, self._ids, "text"), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """ids (T,) -> text of T characters."""
        return "".join(self.chars[i] for i in _check_ids(ids, self.vocab_size))


class PairTokenizer(_OneList):
    """Seed 002's translation vocabulary: ``<pad> <bos> <eos> <sep>`` as ids 0-3, then every
    character of the training pairs in sorted order, with English spaces written as ``'▁'``.

    A pair encodes as ``<bos> zh <sep> en <eos> <pad>...``: a decoder-only model learns to
    continue the prompt ``<bos> zh <sep>`` with the English side.
    """

    kind, _field = "pair", "vocab"
    SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>")
    pad_id, bos_id, eos_id, sep_id = range(4)

    def __init__(self, vocab: Sequence[str]):
        vocab = list(vocab)
        if tuple(vocab[:4]) != self.SPECIALS:
            raise ValueError(f"vocab must start with {self.SPECIALS}, got {tuple(vocab[:4])}")
        _check_chars(vocab[4:])
        self.vocab = vocab
        self._ids = {c: i for i, c in enumerate(vocab)}  # specials are multi-char: no clash

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]]) -> PairTokenizer:
        chars: set[str] = set()
        for zh, en in pairs:
            chars.update(zh)
            chars.update(en.replace(" ", SPACE))
        return cls([*cls.SPECIALS, *sorted(chars)])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ids (T,) int32, spaces written as ``'▁'``; no specials added."""
        return np.asarray(_lookup(text.replace(" ", SPACE), self._ids, f"text {text!r:.40}"), np.int32)

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> PairTokenizer:
        """The same vocabulary built from single texts (classification, both seq2seq sides)."""
        return cls([*cls.SPECIALS, *sorted(set().union(*(t.replace(" ", SPACE) for t in texts)))])

    def prompt(self, zh: str) -> np.ndarray:
        """``<bos> zh <sep>``: ids (len(zh) + 2,) int32, the context for generating English."""
        return np.asarray([self.bos_id, *_lookup(zh, self._ids, f"zh {zh!r}"), self.sep_id], np.int32)

    def encode_pair(self, zh: str, en: str, max_len: int = 40, *, truncate: bool = False) -> np.ndarray:
        """-> ids (max_len,) int32: ``<bos> zh <sep> en <eos>`` right-padded with ``<pad>``.

        A longer pair raises unless ``truncate=True``, which keeps the first ``max_len`` ids as
        seed 002 does (so ``<eos>`` may be cut). Seed 002 turns unknown characters into ``<pad>``;
        here they raise, because a pad inside a sentence silently corrupts the target.
        """
        _int_at_least("max_len", max_len, 1)
        en_ids = _lookup(en.replace(" ", SPACE), self._ids, f"en {en!r}")
        ids = [*self.prompt(zh).tolist(), *en_ids, self.eos_id]
        if len(ids) > max_len and not truncate:
            raise ValueError(f"pair ({zh!r}, {en!r}) needs {len(ids)} tokens but max_len={max_len}; "
                             "raise max_len or pass truncate=True")
        ids = ids[:max_len]
        return np.asarray(ids + [self.pad_id] * (max_len - len(ids)), dtype=np.int32)

    def decode_en(self, ids: Sequence[int] | np.ndarray) -> str:
        """ids (T,) -> the English between the first ``<sep>`` and the next ``<eos>``/``<pad>``.

        As in seed 002: later ``<sep>`` ids are skipped, other specials appear by name, ``'▁'``
        becomes a space and the result is stripped. Ids outside the vocabulary raise (the seed
        printed '?').
        """
        out, in_en = [], False
        for i in _check_ids(ids, self.vocab_size):
            if i == self.sep_id:
                in_en = True
            elif in_en:
                if i in (self.eos_id, self.pad_id):
                    break
                out.append(self.vocab[i])
        return "".join(out).replace(SPACE, " ").strip()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """ids (T,) -> every token, specials by name (for inspection)."""
        return "".join(self.vocab[i] for i in _check_ids(ids, self.vocab_size)).replace(SPACE, " ")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) wrapping a ``tokenizers.Tokenizer``: any text encodes."""

    kind = "bpe"

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer  # optional dependency, needed for BPE only

        self._tok = Tokenizer.from_str(tokenizer_json)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ids (T,) int32."""
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """ids (T,) -> text."""
        return self._tok.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "json": self._tok.to_str()}

    @classmethod
    def from_dict(cls, d: dict) -> BPETokenizer:
        _expect_kind(d, cls.kind)
        return cls(d["json"])


def train_bpe(text_or_path: str | os.PathLike, vocab_size: int, *, min_frequency: int = 2,
              special_tokens: Sequence[str] = ()) -> BPETokenizer:
    """Train byte-level BPE locally (no downloads).

    A ``str`` is the training text itself; an ``os.PathLike`` (e.g. ``pathlib.Path``) is read as
    UTF-8. ``vocab_size`` counts the 256 byte tokens and the specials; it is an upper bound, as a
    small text runs out of pairs worth merging before reaching it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = load_text(text_or_path) if isinstance(text_or_path, os.PathLike) else text_or_path
    if not isinstance(text, str) or not text:
        raise ValueError(f"train_bpe needs non-empty text or a path, got {type(text).__name__} {text!r:.40}")
    floor = 256 + len(special_tokens)  # every byte keeps its own token, so nothing is unknown
    if not isinstance(vocab_size, int) or vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size!r} is below {floor} (256 bytes + "
                         f"{len(special_tokens)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return BPETokenizer(tok.to_str())


class IdTokenizer:
    """No text, only ids [0, vocab_size): token files without a tokenizer (nanoGPT's GPT-2 .bin
    files have no meta.pkl). ``decode`` writes the ids comma-separated; ``encode`` raises."""

    kind = "ids"

    def __init__(self, vocab_size: int):
        _int_at_least("vocab_size", vocab_size, 1)
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> np.ndarray:
        raise ValueError("this run has no tokenizer (token files without one): pass --prompt-ids 1,2,3")

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return ",".join(map(str, _check_ids(ids, self.vocab_size)))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self._vocab_size}

    @classmethod
    def from_dict(cls, d: dict) -> IdTokenizer:
        _expect_kind(d, cls.kind)
        return cls(d["vocab_size"])


_TOKENIZERS = {cls.kind: cls for cls in (CharTokenizer, PairTokenizer, BPETokenizer, IdTokenizer)}


def tokenizer_from_dict(d: dict) -> CharTokenizer | PairTokenizer | BPETokenizer:
    """Inverse of every tokenizer's ``to_dict``, dispatching on ``d['kind']``."""
    kind = d.get("kind")
    if kind == "hf":  # an HF directory's tokenizer.json (jaxgpt.data.hf_tokenizer)
        from jaxgpt.data.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dict(d)
    if kind not in _TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {tuple(_TOKENIZERS)} "
                         "or 'hf' (an HF directory's tokenizer.json)")
    return _TOKENIZERS[kind].from_dict(d)


