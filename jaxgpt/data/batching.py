"""Deterministic batching (numpy only).

Every batch is a pure function of ``(seed, step)``, so a run resumed at step s sees exactly the
batches it would have seen without the interruption.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxgpt.core.validate import int_at_least as _int_at_least
from jaxgpt.data.tokenizers import PairTokenizer
from jaxgpt.data.order import epoch_starts

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


def get_batch(data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int, order: str = "random"
              ) -> tuple[np.ndarray, np.ndarray]:
    """Windows of ``data`` (N,): x (B, T) int32 and y (B, T) int32 with y = x shifted left by one token,
    depending only on ``(seed, step)``. ``order`` (TrainConfig.data_order): 'random', starts uniform in
    [0, N - T - 1]; 'epochs', every window of T + 1 tokens once an epoch (``jaxgpt.data.order``)."""
    data = np.asarray(data)
    if data.ndim != 1 or data.dtype.kind not in "iu":
        raise ValueError(f"data must be a 1-D integer array, got shape {data.shape} dtype {data.dtype}")
    _int_at_least("batch_size", batch_size, 1)
    _int_at_least("seq_len", seq_len, 1)
    _int_at_least("seed", seed, 0)
    _int_at_least("step", step, 0)
    if len(data) < seq_len + 1:  # one window needs T inputs plus the target after the last one
        raise ValueError(f"data has {len(data)} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    if order == "epochs":
        starts = epoch_starts(len(data), batch_size, seq_len, seed, step)
    else:
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
