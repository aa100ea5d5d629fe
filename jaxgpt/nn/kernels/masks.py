"""The masks every attention kernel applies, built here and nowhere else.

A mask is bool, True = attend, broadcastable to (B, H, Tq, Tk). Causal: the query at absolute
position p sees the keys at positions <= p. Positions and offsets may be traced (a cache index,
a block's start), so one compiled program serves every decode step and every block.

Segment ids (B, T) pack several documents into one row: a query sees a key only when both carry
the same id (``segment_mask``; the blocked and C++ kernels compare the ids block by block instead
of building the (Tq, Tk) mask).
"""
from __future__ import annotations

import jax.numpy as jnp

NO_WINDOW = 2 ** 30  # a window past any context: a layer that attends globally, where windows are traced

def _positions(n: int, start):
    # A literal 0 start adds no op: plain causal attention traces the same program as before.
    return jnp.arange(n) if isinstance(start, int) and start == 0 else start + jnp.arange(n)


def causal_mask(q_len: int, k_len: int, q_offset=0, *, q_start=0, k_start=0, window=None):
    """(q_len, k_len) bool, True where query q_start + i (absolute position q_offset + q_start + i)
    may see key k_start + j: j <= that position, and (``window`` W) j > that position - W.
    The blocked kernel passes its block's starts."""
    keys, queries = _positions(k_len, k_start)[None, :], _positions(q_len, q_start)[:, None] + q_offset
    allowed = keys <= queries
    return allowed if window is None else allowed & (keys > queries - window)


def keys_before(k_len: int, limit, *, k_start=0):
    """(k_len,) bool, True for keys k_start + j < limit: a cache's written slots, or a block's
    keys that are not padding."""
    return _positions(k_len, k_start) < limit


def segment_mask(q_segments, k_segments):
    """(B, 1, Tq, Tk) bool, True where query i and key j carry the same segment id: packed documents
    see only their own tokens. q_segments (B, Tq), k_segments (B, Tk) integer ids."""
    return (q_segments[:, :, None] == k_segments[:, None, :])[:, None]


def both(a, b):
    """a & b where either may be None (no constraint)."""
    return b if a is None else a if b is None else a & b


def as_4d(mask):
    """A validated bool mask as (B|1, H|1, Tq|1, Tk|1)."""
    m = jnp.asarray(mask)
    return m.reshape((1,) * (4 - m.ndim) + m.shape)


def grouped_mask(mask, h_kv: int, g: int):
    """A validated bool mask as (B|1, H_kv|1, G|1, Tq|1, Tk|1): query head = kv_head * g + group."""
    m = as_4d(mask)
    return m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], h_kv, g, *m.shape[2:])
