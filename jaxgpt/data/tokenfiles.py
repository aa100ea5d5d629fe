"""Token-file datasets (numpy only): a directory of ``.bin`` token files, memory-mapped, never read whole.

Two layouts are read:

* nanoGPT's, as its ``data/*/prepare.py`` writes it: ``train.bin`` / ``val.bin`` as uint16, and
  ``meta.pkl`` = ``{'vocab_size', 'itos', 'stoi'}`` for characters (no ``meta.pkl``: GPT-2 ids, the
  vocabulary then comes from the model config);
* jaxgpt's (``jaxgpt prepare``): ``meta.json`` with ``vocab_size``, ``dtype`` (uint16 or uint32),
  ``tokenizer`` (a tokenizer dict, ``jaxgpt.data.tokenizer_from_dict``), ``eos_id``, ``documents``
  and ``tokens`` per split, and optionally ``files`` = ``{'train': [...], 'val': [...]}`` for
  shards (default ``train.bin`` / ``val.bin``); shards read as one concatenated stream.

Every problem is a ``ValueError`` / ``FileNotFoundError`` naming the file, the value and the limit.
Ids are checked against the vocabulary on a sample at open (``check='sample'``, a few MB read) or
in full (``check='full'``, streamed in chunks); training checks every batch again on the host.
"""
from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxgpt.data.order import epoch_starts

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SAMPLE_CHUNKS, CHUNK = 64, 1 << 15  # the sampled check reads 64 evenly spaced runs of 32k tokens


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds ids [0, vocab_size): uint16 up to 65,536 tokens, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class Tokens:
    """Token files read as one stream of ids: ``len``, ``windows(starts, n)`` and chunked reads.

    Each file is opened as an ``np.memmap`` (``parts``: size, dtype and random access without
    reading it) and, on POSIX, read with ``os.pread``: random windows of a file much larger than the
    page cache fault in a page per window through the mapping, far slower than pread (docs/data.md has
    the figures), and mapped pages count in the process's RSS while read ones stay in the page cache.
    Nothing is read whole either way."""

    def __init__(self, paths: Sequence[Path], dtype: str):
        self.paths, self.dtype = [Path(p) for p in paths], np.dtype(DTYPES[dtype])
        self.parts = []
        for p in self.paths:
            size = p.stat().st_size
            if size % self.dtype.itemsize:
                raise ValueError(f"{str(p)!r} has {size} bytes, not a multiple of {self.dtype.itemsize} "
                                 f"({self.dtype.name}): a truncated or foreign file")
            # np.memmap refuses empty files; an empty shard contributes nothing
            self.parts.append(np.memmap(p, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype))
        self.offsets = np.cumsum([0] + [len(a) for a in self.parts])  # (files + 1,)
        self.reads = 0  # windows read (tests check that a process reads only its own rows)
        self._fds = [os.open(p, os.O_RDONLY) for p in self.paths] if hasattr(os, "pread") else None

    _close = staticmethod(os.close)  # bound now: at interpreter exit the module global `os` may be None already

    def __del__(self):
        for fd in getattr(self, "_fds", None) or ():
            self._close(fd)

    def _part(self, i: int, lo: int, n: int) -> np.ndarray:
        """ids [lo, lo + n) of file i, as a new array."""
        if self._fds is None:
            return np.array(self.parts[i][lo:lo + n])
        size = self.dtype.itemsize
        buf = os.pread(self._fds[i], n * size, lo * size)
        return np.frombuffer(buf, self.dtype).copy() if len(buf) == n * size else np.array(self.parts[i][lo:lo + n])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        """ids [start, start + n) as a new array (may span files; as a slice, it stops at the end)."""
        if len(self.parts) == 1:
            return self._part(0, start, min(n, len(self) - start))
        out, pos, end = [], start, min(start + n, len(self))
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while pos < end:
            lo = pos - int(self.offsets[i])
            take = min(end - pos, len(self.parts[i]) - lo)
            out.append(self._part(i, lo, take))
            pos, i = pos + take, i + 1
        return np.concatenate(out) if out else np.zeros(0, self.dtype)

    def windows(self, starts: np.ndarray, n: int) -> np.ndarray:
        """(len(starts), n) int32: the n ids from each start."""
        self.reads += len(starts)
        out = np.empty((len(starts), n), np.int32)
        for r, s in enumerate(starts):
            out[r] = self.read(int(s), n)
        return out

    def max_id(self, full: bool) -> tuple[int, int]:
        """(largest id, its position) over a sample of the stream, or all of it (chunked)."""
        n = len(self)
        if n == 0:
            return -1, -1
        if full or n <= SAMPLE_CHUNKS * CHUNK:
            starts = range(0, n, 1 << 22)
            size = 1 << 22
        else:
            starts = np.linspace(0, n - CHUNK, SAMPLE_CHUNKS).astype(np.int64)
            size = CHUNK
        best, where = -1, -1
        for s in starts:
            chunk = self.read(int(s), min(size, n - int(s)))
            i = int(chunk.argmax())
            if int(chunk[i]) > best:
                best, where = int(chunk[i]), int(s) + i
        return best, where


@dataclass
class TokenDir:
    """An opened token directory: the two splits, the vocabulary and the tokenizer dict (None:
    ids only, e.g. nanoGPT's GPT-2 files without meta.pkl)."""
    path: Path
    train: Tokens
    val: Tokens | None
    vocab_size: int
    tokenizer: dict | None
    meta: dict = field(default_factory=dict)
    layout: str = "jaxgpt"  # 'jaxgpt' (meta.json), 'nanogpt' (meta.pkl / bare .bin files)

    @property
    def eos_id(self) -> int | None:
        return self.meta.get("eos_id")


def is_token_dir(path: str | Path) -> bool:
    """A directory with train.bin, a meta.json or a meta.pkl: read as token files."""
    p = Path(path)
    return p.is_dir() and any((p / n).is_file() for n in ("train.bin", "meta.json", "meta.pkl"))


def read_meta(path: str | Path) -> dict:
    """The directory's metadata as a dict with at least ``vocab_size`` (None when neither meta.json
    nor meta.pkl exists), ``dtype``, ``layout``, and ``tokenizer`` (a tokenizer dict or None)."""
    p = Path(path)
    if (p / "meta.json").is_file():
        try:
            meta = json.loads((p / "meta.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(p / 'meta.json')!r} is not valid JSON: {e}") from None
        for key in ("vocab_size", "dtype"):
            if key not in meta:
                raise ValueError(f"{str(p / 'meta.json')!r} lacks {key!r}")
        return {**meta, "layout": "jaxgpt"}
    if (p / "meta.pkl").is_file():
        with open(p / "meta.pkl", "rb") as f:
            # nanoGPT's own metadata (a dict of ints and strings); pickle: open only files you trust
            raw = pickle.load(f)
        if not isinstance(raw, dict) or "vocab_size" not in raw:
            raise ValueError(f"{str(p / 'meta.pkl')!r} is not nanoGPT metadata (a dict with 'vocab_size')")
        tok = None
        if "itos" in raw:  # nanoGPT's character vocabulary: {id: char}
            itos = raw["itos"]
            chars = [itos[i] for i in range(len(itos))]
            tok = {"kind": "char", "chars": chars}
        return {"vocab_size": int(raw["vocab_size"]), "dtype": raw.get("dtype", "uint16"), "tokenizer": tok,
                "layout": "nanogpt"}
    return {"vocab_size": None, "dtype": "uint16", "tokenizer": None, "layout": "nanogpt"}


def _split_files(p: Path, meta: dict, split: str) -> list[Path]:
    names = meta.get("files", {}).get(split, [f"{split}.bin"])
    return [p / n for n in names]


def open_tokens(path: str | Path, *, vocab_size: int | None = None, need_val: bool = False,
                check: str = "sample") -> TokenDir:
    """Open a token directory. ``vocab_size``: the model's, used when the directory records none
    (nanoGPT's GPT-2 files). ``need_val``: a missing or empty val split is an error (evaluation
    was asked for). ``check``: 'sample' (ids of a few MB checked against the vocabulary), 'full'
    (every id, streamed) or 'none'."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no token directory at {str(p)!r}")
    meta = read_meta(p)
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"{str(p)!r}: dtype {meta['dtype']!r} is not one of {tuple(DTYPES)}")
    vocab = meta["vocab_size"] if meta["vocab_size"] is not None else vocab_size
    if vocab is None:
        raise ValueError(f"{str(p)!r} has no meta.json or meta.pkl: give the vocabulary size (--set vocab_size=N)")
    cap = np.iinfo(DTYPES[meta["dtype"]]).max + 1
    if vocab > cap:
        raise ValueError(f"{str(p)!r}: vocab_size={vocab} does not fit dtype {meta['dtype']} (at most {cap} ids); "
                         f"write the files as {dtype_for(vocab)}")
    train_files = _split_files(p, meta, "train")
    missing = [str(f) for f in train_files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{str(p)!r} has no {Path(missing[0]).name} (training tokens): expected {missing[0]!r}")
    train = Tokens(train_files, meta["dtype"])
    if len(train) == 0:
        raise ValueError(f"{str(train_files[0])!r} holds no tokens")
    val_files = _split_files(p, meta, "val")
    val = Tokens(val_files, meta["dtype"]) if all(f.is_file() for f in val_files) else None
    if need_val and (val is None or len(val) == 0):
        what = "is empty" if val is not None else "is missing"
        raise ValueError(f"{str(val_files[0])!r} {what}, but evaluation needs validation tokens: rerun jaxgpt prepare "
                         "with its default --min-val-tokens (or a larger --val-fraction), or train without evaluation "
                         "(--set val_fraction=0)")
    if check not in ("sample", "full", "none"):
        raise ValueError(f"check must be 'sample', 'full' or 'none', got {check!r}")
    if check != "none":
        for name, toks in (("train", train), ("val", val)):
            if toks is None:
                continue
            top, pos = toks.max_id(full=check == "full")
            if top >= vocab:
                how = "in full" if check == "full" or len(toks) <= SAMPLE_CHUNKS * CHUNK else "in a sample"
                raise ValueError(f"{str(p)!r} {name} split: token id {top} at position {pos} is outside the "
                                 f"vocabulary [0, {vocab}) (checked {how})")
    return TokenDir(p, train, val, int(vocab), meta.get("tokenizer"), meta, meta["layout"])


# --- Batches: each process reads only its rows of the global batch ---------------------------

def window_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """(batch_size,) starts of the global batch of ``step``: uniform in [0, n_tokens - seq_len - 1],
    a pure function of (seed, step), drawn as ``jaxgpt.data.get_batch`` draws them."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"the token file has {n_tokens} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    return np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len, size=batch_size)


def global_batch(tokens: Tokens, batch_size: int, seq_len: int, seed: int, step: int,
                 rows: Sequence[int] | None = None, order: str = "random") -> tuple[np.ndarray, np.ndarray]:
    """x, y (batch_size, seq_len) int32 of the global batch; with ``rows`` only those rows are read
    (the others stay 0: another process holds them), so a host reads its slice and nothing else.
    ``order``: TrainConfig.data_order ('random': ``window_starts``; 'epochs': ``epoch_starts``)."""
    starts = (epoch_starts if order == "epochs" else window_starts)(len(tokens), batch_size, seq_len, seed, step)
    w = np.zeros((batch_size, seq_len + 1), np.int32)
    idx = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
    w[idx] = tokens.windows(starts[idx], seq_len + 1)
    return w[:, :-1], w[:, 1:]


def write_meta(out: str | Path, meta: dict[str, Any]) -> Path:
    """meta.json, written atomically."""
    path = Path(out) / "meta.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def write_nanogpt_meta(out: str | Path, chars: Sequence[str]) -> Path:
    """nanoGPT's meta.pkl for a character vocabulary: {'vocab_size', 'itos', 'stoi'}."""
    path = Path(out) / "meta.pkl"
    with open(path, "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return path


__all__ = ["DTYPES", "TokenDir", "Tokens", "dtype_for", "global_batch", "is_token_dir", "open_tokens", "read_meta",
           "window_starts", "write_meta", "write_nanogpt_meta"]
