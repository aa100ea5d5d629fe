"""The order in which training reads its windows: epochs without replacement, and mixtures of
several sources at fixed weights. Framework-free, and a pure function of (seed, global sample index),
so a run resumed at any step reads what it would have read, on any number of processes (each one
computes the whole global batch's window ids, a few integers, and reads only its own rows).

Epochs: the stream of n tokens is cut into W = (n - 1) // seq_len windows of seq_len + 1 tokens, one
every seq_len tokens (each token is a target once an epoch). Epoch e visits them in a permutation
drawn from (seed, e): global sample i is window perm_{i // W}[i % W].

Mixtures: sources with weights w_j. The weights are rounded to a period of P <= 1000 slots with
n_j = round(w_j P) slots each, laid out by largest deficit (each slot goes to the source furthest
behind its share), so every prefix of the schedule is within one sample of its weights. Sample i
is slot i % P; its index within source j is (i // P) * n_j + (slots of j before it in the period),
an O(1) count, so each source runs its own epochs without replacement.
"""
from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np

MAX_PERIOD = 1000


def n_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens, one every seq_len tokens."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"{n_tokens} tokens hold no window: seq_len={seq_len} needs at least {seq_len + 1}")
    return (n_tokens - 1) // seq_len


@functools.lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x0E9]).permutation(n)  # 0x0E9: apart from the batch draws


def epoch_windows(n: int, seed: int, samples: np.ndarray) -> np.ndarray:
    """Window ids in [0, n) of the global ``samples`` indices (any int array): epoch i // n, in the
    epoch's permutation. One epoch (n consecutive samples from a multiple of n) visits each window once."""
    samples = np.asarray(samples, np.int64)
    out = np.empty(samples.shape, np.int64)
    epochs = samples // n
    for e in np.unique(epochs):
        at = epochs == e
        out[at] = _permutation(n, seed, int(e))[samples[at] % n]
    return out


def epoch_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """(batch_size,) window starts of the global batch of ``step`` in epoch order: global samples
    step * batch_size ..., each window of seq_len + 1 tokens (one every seq_len) once an epoch."""
    samples = step * batch_size + np.arange(batch_size, dtype=np.int64)
    return epoch_windows(n_windows(n_tokens, seq_len), seed, samples) * seq_len


def mixture_counts(weights) -> tuple[int, ...]:
    """Slots of each source in one period: the smallest period <= MAX_PERIOD holding the weights
    exactly, else MAX_PERIOD slots shared by largest remainder. Every weight must be > 0."""
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(w > 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"mixture weights must be positive numbers, got {list(weights)}")
    w = w / w.sum()
    fracs = [Fraction(float(x)).limit_denominator(MAX_PERIOD) for x in w]
    period = int(np.lcm.reduce([f.denominator for f in fracs]))
    if period <= MAX_PERIOD and all(abs(float(f) - x) < 1e-9 for f, x in zip(fracs, w)):
        return tuple(int(f * period) for f in fracs)
    counts = np.floor(w * MAX_PERIOD).astype(np.int64)
    rest = MAX_PERIOD - int(counts.sum())
    counts[np.argsort(-(w * MAX_PERIOD - counts), kind="stable")[:rest]] += 1
    if np.any(counts == 0):
        raise ValueError(f"mixture weights {list(weights)}: a weight below 1/{MAX_PERIOD} would never be read")
    return tuple(int(c) for c in counts)


@functools.lru_cache(maxsize=8)
def _pattern(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, that slot's index among its source's slots) over one period."""
    period = sum(counts)
    share = np.asarray(counts, np.float64) / period
    got = np.zeros(len(counts), np.int64)
    source = np.empty(period, np.int64)
    rank = np.empty(period, np.int64)
    for s in range(period):
        j = int(np.argmax((s + 1) * share - got))  # the source furthest behind its share
        source[s], rank[s] = j, got[j]
        got[j] += 1
    return source, rank


def mixture_samples(counts: tuple[int, ...], samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within that source) of each global sample index, O(1) each."""
    samples = np.asarray(samples, np.int64)
    source, rank = _pattern(tuple(counts))
    slot = samples % len(source)
    j = source[slot]
    return j, (samples // len(source)) * np.asarray(counts, np.int64)[j] + rank[slot]


__all__ = ["MAX_PERIOD", "epoch_starts", "epoch_windows", "mixture_counts", "mixture_samples", "n_windows"]
