"""Byte ranges of one large text file, so that ``jaxgpt prepare`` spreads it over its workers and a
rerun resumes at any finished range (each range is a shard with its own ``.done`` marker).

A range is cut where the documents it yields are exactly those of reading the file whole:

- ``text_unit='line'`` (a document per line, ``str.splitlines``): just past a ``'\\n'``;
- ``'paragraph'`` (``text.split('\\n\\n')``): just past an isolated ``'\\n\\n'``, a run of exactly
  two newlines, which a left-to-right split of the whole text also splits at;
- ``'file'`` (the file is one document): just past a ``'\\n'``, with the character tokenizer only,
  whose ids do not depend on where the text was cut; the pieces are one document, so only the
  last one is followed by EOS. A subword tokenizer could merge across a cut, so such a file is
  read whole by one worker (``splittable``).

Each nominal boundary (a multiple of ``shard_bytes``) moves forward to the first cut at or after
it, so neighbouring ranges agree on it and no byte is read twice or skipped. The cut is found in
the raw bytes: ``'\\n'`` never occurs inside a multi-byte UTF-8 character.
"""
from __future__ import annotations

import mmap
from pathlib import Path

SHARD_BYTES = 64 << 20  # a text file larger than this is cut into ranges of about this size


def splittable(text_unit: str, tokenizer: str) -> bool:
    """Whether a text file may be cut: documents per line or paragraph always; a whole-file
    document only with the character tokenizer."""
    return text_unit in ("line", "paragraph") or tokenizer == "char"


def cut(path: str | Path, pos: int, text_unit: str) -> int:
    """The first cut at or after byte ``pos`` of the file (0 and its size are cuts). The file is
    memory-mapped: the search is bytes.find over the pages it touches, whatever the file's size."""
    size = Path(path).stat().st_size
    if pos <= 0 or pos >= size:
        return max(0, min(pos, size))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        j = pos - 1
        while (j := m.find(b"\n", j)) >= 0:
            p = j + 1
            if text_unit != "paragraph" or (p >= 2 and m[p - 2:p - 1] == b"\n" and (p < 3 or m[p - 3:p - 2] != b"\n")
                                            and m[p:p + 1] != b"\n"):
                return p
            j = p
    return size


def plan(path: str | Path, text_unit: str, shard_bytes: int = SHARD_BYTES) -> list[dict]:
    """The ranges of one text file: shards {'kind': 'text_range', 'path', 'start', 'stop', 'eos'}
    (nominal bounds; ``read`` moves each to its cut). 'eos': the range ends a document ('file':
    the last range only)."""
    size = Path(path).stat().st_size
    bounds = list(range(0, size, shard_bytes)) + [size]
    return [{"kind": "text_range", "path": str(path), "start": a, "stop": b,
             "eos": text_unit != "file" or b == size} for a, b in zip(bounds, bounds[1:])]


def read(shard: dict, text_unit: str) -> str:
    """The text of a range, from its first cut to the next range's."""
    a, b = cut(shard["path"], shard["start"], text_unit), cut(shard["path"], shard["stop"], text_unit)
    with open(shard["path"], "rb") as f:
        f.seek(a)
        return f.read(max(b - a, 0)).decode("utf-8")


__all__ = ["SHARD_BYTES", "cut", "plan", "read", "splittable"]
