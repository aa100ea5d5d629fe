"""Tokenizers, built-in corpora and deterministic batching (numpy only: no torch, no jax).

Three tokenizers share ``encode``/``decode``/``vocab_size``/``to_dict``/``from_dict``, and
``tokenizer_from_dict`` rebuilds any of them from the JSON-friendly dict stored in a checkpoint:

* ``CharTokenizer``: the plain sorted-character vocabulary of seeds 000 and 003.
* ``PairTokenizer``: seed 002's zh-en vocabulary, ``<pad> <bos> <eos> <sep>`` then characters.
* ``BPETokenizer``: byte-level BPE trained locally with the ``tokenizers`` package.

Every batch is a pure function of ``(seed, step)``, so a run resumed at step s sees exactly the
batches it would have seen without the interruption.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig

# Opt-in target value for "no loss here" (the torch and Hugging Face convention). Seed 002
# keeps <pad> in its targets and passes ignore_index=pad_id to the loss instead; encode_pairs
# does the same unless asked for IGNORE_INDEX.
IGNORE_INDEX = -100
SPACE = "\u2581"  # '▁': seed 002 writes English spaces as the SentencePiece word marker

CORPORA = ("seed-synthetic", "zh-en")
PAIR_CORPORA = ("zh-en",)
_SYNTHETIC_SENTENCES = (
    "the cat sat on the mat ",
    "the dog ran in the park ",
    "a bird flew over the tree ",
    "the sun is bright today ",
    "hello world this is a test ",
)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


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


class CharTokenizer:
    """One id per character, ids in sorted character order (seeds 000 and 003)."""

    kind = "char"

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

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        _expect_kind(d, cls.kind)
        return cls(d["chars"])


class PairTokenizer:
    """Seed 002's translation vocabulary: ``<pad> <bos> <eos> <sep>`` as ids 0-3, then every
    character of the training pairs in sorted order, with English spaces written as ``'▁'``.

    A pair encodes as ``<bos> zh <sep> en <eos> <pad>...``: a decoder-only model learns to
    continue the prompt ``<bos> zh <sep>`` with the English side.
    """

    kind = "pair"
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

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab": list(self.vocab)}

    @classmethod
    def from_dict(cls, d: dict) -> PairTokenizer:
        _expect_kind(d, cls.kind)
        return cls(d["vocab"])


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


_TOKENIZERS = {cls.kind: cls for cls in (CharTokenizer, PairTokenizer, BPETokenizer)}


def tokenizer_from_dict(d: dict) -> CharTokenizer | PairTokenizer | BPETokenizer:
    """Inverse of every tokenizer's ``to_dict``, dispatching on ``d['kind']``."""
    kind = d.get("kind")
    if kind == "hf":  # an HF directory's tokenizer.json (jaxgpt.hf_tokenizer)
        from jaxgpt.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dict(d)
    if kind not in _TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {tuple(_TOKENIZERS)} "
                         "or 'hf' (an HF directory's tokenizer.json)")
    return _TOKENIZERS[kind].from_dict(d)


# The batch dict each model kind trains on: inputs in call order, then the targets.
BATCH_KEYS = {
    ModelConfig: ("x", "y"),  # x (B, T) ids, y (B, T) next ids (IGNORE_INDEX = no loss)
    BertConfig: ("input_ids", "attention_mask", "labels"),  # (B, T), (B, T) bool, (B,)
    EncDecConfig: ("src", "tgt", "src_mask", "labels"),  # (B, S), (B, T), (B, S) bool, (B, T)
}


def batch_keys(config) -> tuple[str, ...]:
    """Keys of the batch dict ``config``'s model trains on: its inputs in call order, then targets."""
    return BATCH_KEYS[type(config)]



# --- Built-in corpora --------------------------------------------------------------------------

def _seed_synthetic_text() -> str:
    # Seed 000 draws the sentences from numpy's global RNG right after np.random.seed(42); a
    # fresh RandomState(42) yields the same draws without touching anyone's global state.
    rng = np.random.RandomState(42)
    parts = ["abcdefg" * 5 + " "] * 200 + ["0123456789" * 3 + " "] * 200
    parts += [_SYNTHETIC_SENTENCES[rng.randint(len(_SYNTHETIC_SENTENCES))] for _ in range(500)]
    return "".join(parts)


def builtin_pairs(name: str = "zh-en") -> list[tuple[str, str]]:
    """The sentence pairs shipped with the package: ``'zh-en'`` = seed 002's 50 zh-en pairs."""
    if name not in PAIR_CORPORA:
        raise ValueError(f"unknown pair corpus {name!r}; available: {PAIR_CORPORA}")
    text = (resources.files("jaxgpt") / "corpora" / "zh_en_pairs.tsv").read_text(encoding="utf-8")
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(f"zh_en_pairs.tsv line {lineno}: expected 2 tab-separated fields, "
                             f"got {len(fields)}")
        pairs.append((fields[0], fields[1]))
    return pairs


def builtin_corpus(name: str) -> str:
    """Text of a built-in corpus.

    ``'seed-synthetic'``: seed 000's character corpus (repeated letters, repeated digits, then 500
    random sentences), 25,752 characters. ``'zh-en'``: the pairs as ``zh<TAB>en`` lines.
    """
    if name == "seed-synthetic":
        return _seed_synthetic_text()
    if name == "zh-en":
        return "".join(f"{zh}\t{en}\n" for zh, en in builtin_pairs(name))
    raise ValueError(f"unknown corpus {name!r}; available: {CORPORA}")


# --- Language-model batches --------------------------------------------------------------------

def load_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no text file at {str(p)!r} (resolved to {str(p.resolve())!r})")
    return p.read_text(encoding="utf-8")


def split_train_val(ids: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """ids (N,) -> (train (n,), val (N - n,)) with n = int((1 - val_fraction) * N): contiguous, the
    validation text is the tail, as in seed 003 (so no window straddles both splits).
    val_fraction=0: everything is training text and val is empty."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if val_fraction == 0.0:
        return ids, ids[:0]
    n = int((1.0 - val_fraction) * len(ids))
    if n == 0 or n == len(ids):
        raise ValueError(f"val_fraction={val_fraction} splits {len(ids)} tokens into {n} train and "
                         f"{len(ids) - n} val; both must be non-empty")
    return ids[:n], ids[n:]


def get_batch(data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Random windows of ``data`` (N,): x (B, T) int32 and y (B, T) int32 with y = x shifted left
    by one token. The starts are uniform in [0, N - T - 1] and depend only on ``(seed, step)``."""
    data = np.asarray(data)
    if data.ndim != 1 or data.dtype.kind not in "iu":
        raise ValueError(f"data must be a 1-D integer array, got shape {data.shape} dtype {data.dtype}")
    _int_at_least("batch_size", batch_size, 1)
    _int_at_least("seq_len", seq_len, 1)
    _int_at_least("seed", seed, 0)
    _int_at_least("step", step, 0)
    if len(data) < seq_len + 1:  # one window needs T inputs plus the target after the last one
        raise ValueError(f"data has {len(data)} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    starts = np.random.default_rng([seed, step]).integers(0, len(data) - seq_len, size=batch_size)
    windows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


# --- Fixed-length batches: translation pairs and classification --------------------------------

def encode_pairs(tokenizer: PairTokenizer, pairs: Sequence[tuple[str, str]], max_len: int = 40, *,
                 truncate: bool = False, target_pad: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seed 002's ``TranslationDataset`` as arrays: x (N, max_len - 1) int32 = ids[:, :-1] and
    y (N, max_len - 1) int32 = ids[:, 1:], ids from ``tokenizer.encode_pair``.

    Padding positions of y hold ``tokenizer.pad_id`` like the seed (whose loss then ignores
    pad_id), or ``target_pad`` if given, e.g. ``IGNORE_INDEX``.
    """
    _int_at_least("max_len", max_len, 2)
    if not pairs:
        raise ValueError("encode_pairs needs at least one pair")
    ids = np.stack([tokenizer.encode_pair(zh, en, max_len, truncate=truncate) for zh, en in pairs])
    x, y = ids[:, :-1], ids[:, 1:].copy()
    if target_pad is not None:
        y[y == tokenizer.pad_id] = target_pad  # <pad> never encodes a character, only padding
    return x, y


def pad_batch(seqs: Sequence[Sequence[int]], max_len: int, pad_id: int, *, truncate: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad B id lists to ``max_len``: ids (B, max_len) int32 and attention_mask (B, max_len)
    bool, True on real tokens. A longer list raises unless ``truncate=True`` keeps its head."""
    _int_at_least("max_len", max_len, 1)
    ids = np.full((len(seqs), max_len), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), max_len), dtype=bool)
    for b, seq in enumerate(seqs):
        seq = np.asarray(seq)
        if seq.ndim != 1 or (seq.size and seq.dtype.kind not in "iu"):
            raise ValueError(f"sequence {b} must be a 1-D integer list, got shape {seq.shape} "
                             f"dtype {seq.dtype}")
        if len(seq) > max_len and not truncate:
            raise ValueError(f"sequence {b} has {len(seq)} tokens but max_len={max_len}; "
                             "pass truncate=True to cut it")
        n = min(len(seq), max_len)
        ids[b, :n] = seq[:n]
        mask[b, :n] = True
    return ids, mask


def shuffled_batch(arrays: Sequence[np.ndarray], batch_size: int, seed: int, step: int
                   ) -> tuple[np.ndarray, ...]:
    """Batch ``step`` of endless shuffled epochs over N rows: the same (B, ...) rows from each array.

    Epoch e = step // (N // B) is the permutation ``default_rng([seed, e])``; its last N % B rows
    are dropped so every batch has one shape (one jit trace), and each row is used once per epoch.
    """
    if not arrays:
        raise ValueError("shuffled_batch needs at least one array")
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError(f"arrays must share their first dimension, got {[len(a) for a in arrays]}")
    _int_at_least("batch_size", batch_size, 1)
    _int_at_least("seed", seed, 0)
    _int_at_least("step", step, 0)
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} is larger than the {n} rows available")
    epoch, i = divmod(step, n // batch_size)
    rows = np.random.default_rng([seed, epoch]).permutation(n)[i * batch_size:(i + 1) * batch_size]
    return tuple(np.asarray(a)[rows] for a in arrays)
