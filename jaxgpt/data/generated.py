"""Built-in generated tasks: small, deterministic data sets made from a seed, for the experiments
that the seeds run on data we do not ship (seed 004's MiniBERT trains on IMDb; its encoder-decoder
has no data at all).

Framework-free (the standard library only): every generator returns plain Python lists of
strings, the same for the same arguments on every machine.

* ``sentiment_rows``: ``(label, text)`` rows, ``label`` ``"1"`` (positive) or ``"0"``, texts made of
  neutral filler words and 1 or 3 sentiment words; the label is the majority polarity. Lengths vary,
  so a batch is padded and the classifier needs its padding mask.
* ``sequence_pairs`` (``copy_pairs``, ``reverse_pairs``, ``sort_pairs``): ``(src, tgt)`` strings
  over a small alphabet, for an encoder-decoder (or a decoder on ``<bos> src <sep> tgt <eos>``).
* ``split_rows``: a held-out test split whose inputs never occur in the training split.
* ``TINY_GPT_TEXT``: seed 004's tiny character-GPT text.
* ``write_tsv``: rows as ``a<TAB>b`` lines (what ``jaxgpt train --data FILE.tsv`` reads).
"""
from __future__ import annotations

import random
from pathlib import Path
from collections.abc import Iterable, Sequence

TINY_GPT_TEXT = "hello world! this is a tiny gpt demo."  # seed 004, "极简GPT模型示例"

POSITIVE = ("good", "great", "fine", "nice", "happy", "love", "best", "fun", "superb", "brilliant",
            "wonderful", "enjoyable")
NEGATIVE = ("bad", "awful", "poor", "sad", "hate", "worst", "dull", "boring", "terrible", "weak",
            "horrible", "annoying")
NEUTRAL = ("the", "movie", "film", "plot", "actor", "story", "was", "is", "a", "it", "this", "and",
           "very", "quite", "scene", "music", "cast", "ending", "script", "really")

SEQUENCE_TASKS = ("copy", "reverse", "sort")
DEFAULT_ALPHABET = "abcdefghij"


def sentiment_rows(n: int, seed: int = 0, *, min_words: int = 3, max_words: int = 9,
                   sentiment_words: Sequence[int] = (1, 3)) -> list[tuple[str, str]]:
    """``n`` rows ``(label, text)``: ``k`` sentiment words (``k`` drawn from ``sentiment_words``,
    odd counts so there is no tie) mixed into neutral filler, ``min_words..max_words`` words in
    all; label ``"1"`` when positive words outnumber negative ones, else ``"0"``. Labels alternate
    (exactly balanced for even ``n``); no text repeats."""
    if any(k % 2 == 0 or k < 1 for k in sentiment_words):
        raise ValueError(f"sentiment_words must be odd counts >= 1, got {tuple(sentiment_words)}")
    if not 1 <= min_words <= max_words or max(sentiment_words) > max_words:
        raise ValueError(f"need 1 <= min_words <= max_words and max(sentiment_words) <= max_words, got "
                         f"{min_words}, {max_words}, {tuple(sentiment_words)}")
    rng = random.Random(seed)
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct rows with these settings")
        label = len(rows) % 2  # alternate: balanced classes
        k = rng.choice(list(sentiment_words))
        majority = k // 2 + 1 + rng.randrange(k - k // 2)  # majority .. k words of the label's polarity
        n_words = rng.randint(max(min_words, k), max_words)
        same, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        words = [rng.choice(same) for _ in range(majority)] + [rng.choice(other) for _ in range(k - majority)]
        words += [rng.choice(NEUTRAL) for _ in range(n_words - k)]
        rng.shuffle(words)
        text = " ".join(words)
        if text in seen:
            continue
        seen.add(text)
        rows.append((str(label), text))
    return rows


def sentiment_label(text: str) -> int:
    """The rule ``sentiment_rows`` labels by: 1 when positive words outnumber negative ones."""
    words = text.split()
    return int(sum(w in POSITIVE for w in words) > sum(w in NEGATIVE for w in words))


def target_of(task: str, src: str) -> str:
    """The target of ``src`` for a sequence task: itself, reversed, or sorted."""
    if task == "copy":
        return src
    if task == "reverse":
        return src[::-1]
    if task == "sort":
        return "".join(sorted(src))
    raise ValueError(f"unknown sequence task {task!r}; expected one of {SEQUENCE_TASKS}")


def sequence_pairs(task: str, n: int, seed: int = 0, *, min_len: int = 3, max_len: int = 8,
                   alphabet: str = DEFAULT_ALPHABET) -> list[tuple[str, str]]:
    """``n`` distinct ``(src, tgt)`` pairs: ``src`` a random string of ``min_len..max_len``
    symbols of ``alphabet`` (repeats allowed), ``tgt = target_of(task, src)``."""
    target_of(task, "")  # validates the name
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if len(set(alphabet)) != len(alphabet) or not alphabet or " " in alphabet:
        raise ValueError(f"alphabet must be distinct non-space symbols, got {alphabet!r}")
    possible = sum(len(alphabet) ** k for k in range(min_len, max_len + 1))
    if n > possible:
        raise ValueError(f"only {possible} distinct sources exist, asked for {n}")
    rng = random.Random(f"{task}:{seed}")
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        src = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if src in seen:
            continue
        seen.add(src)
        pairs.append((src, target_of(task, src)))
    return pairs


def copy_pairs(n: int, seed: int = 0, **kw) -> list[tuple[str, str]]:
    return sequence_pairs("copy", n, seed, **kw)


def reverse_pairs(n: int, seed: int = 0, **kw) -> list[tuple[str, str]]:
    return sequence_pairs("reverse", n, seed, **kw)


def sort_pairs(n: int, seed: int = 0, **kw) -> list[tuple[str, str]]:
    return sequence_pairs("sort", n, seed, **kw)


def split_rows(rows: Sequence[tuple[str, str]], n_test: int, seed: int = 0, *, key: int = 0
               ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Shuffle ``rows`` (seeded) and hold out ``n_test`` of them; field ``key`` (0: a pair's
    source, 1: a labelled row's text) of a test row never occurs in the training rows."""
    if not 0 < n_test < len(rows):
        raise ValueError(f"n_test must be in (0, {len(rows)}), got {n_test}")
    order = list(rows)
    random.Random(seed).shuffle(order)
    test = order[:n_test]
    held = {r[key] for r in test}
    train = [r for r in order[n_test:] if r[key] not in held]
    return train, test


def write_tsv(rows: Iterable[tuple[str, str]], path: str | Path) -> Path:
    """``a<TAB>b`` per line; fields must not contain tabs or newlines."""
    lines = []
    for a, b in rows:
        if any(c in f for f in (a, b) for c in "\t\n\r"):
            raise ValueError(f"row {(a, b)!r} contains a tab or a newline")
        lines.append(f"{a}\t{b}\n")
    path = Path(path)
    path.write_text("".join(lines), encoding="utf-8")
    return path
