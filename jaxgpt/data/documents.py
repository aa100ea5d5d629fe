"""Documents packed into training windows: segment ids and per-document positions from the EOS ids.

``jaxgpt prepare`` writes one EOS after every document and records its id (meta.json ``eos_id``),
so a window of the token stream holds the tail of one document, whole documents, and the head of
another, separated by EOS. ``TrainConfig.documents`` says what the model sees of that:

    'stream'    the window as one sequence (nanoGPT, GPT-2): attention runs across the EOS
    'masked'    segment ids: attention stays inside each document (every kernel compares them)
    'isolated'  segment ids and positions that restart at each document: every document is computed
                as if it were alone in its row (the same loss to rounding, parity_tests/test_documents.py)

An EOS opens the document after it (it is that document's first token, position 0), as GPT-2's
<|endoftext|> separates documents: so the last token of a document predicts the EOS inside its
own document, and the EOS predicts the next document's first token from the EOS alone. No target
crosses a boundary, and none needs masking.

Framework-free NumPy on the host: the ids are part of the batch, as MaxText's ``inputs_segmentation``
and ``inputs_position`` are.
"""
from __future__ import annotations

import numpy as np

from jaxgpt.config.train import DOCUMENTS


def segment_ids(x, eos_id: int) -> np.ndarray:
    """(..., T) ids -> (..., T) int32: the number of EOS at or before each position (0 for the
    document the window opens in)."""
    return np.cumsum(np.asarray(x) == eos_id, axis=-1, dtype=np.int32)


def document_positions(x, eos_id: int) -> np.ndarray:
    """(..., T) ids -> (..., T) int32: each token's position inside its document (0 at each EOS,
    and at the window's first token)."""
    x = np.asarray(x)
    t = np.broadcast_to(np.arange(x.shape[-1], dtype=np.int32), x.shape)
    start = np.maximum.accumulate(np.where(x == eos_id, t, 0), axis=-1)  # the latest EOS at or before
    return (t - start).astype(np.int32)


def annotate(batch: dict, documents: str, eos_id: int | None, source: str = "the data") -> dict:
    """A language-model batch ({'x', 'y'}, any leading axes) with what ``documents`` asks for:
    'segment_ids' ('masked', 'isolated') and 'positions' ('isolated'). 'stream': unchanged."""
    if documents not in DOCUMENTS:
        raise ValueError(f"documents={documents!r} is not one of {DOCUMENTS}")
    if documents == "stream":
        return batch
    if eos_id is None:
        raise ValueError(f"documents={documents!r} needs document boundaries, but {source} has no EOS id: train on "
                         "a token directory from `jaxgpt prepare` (one EOS after each document, its id in "
                         "meta.json), or set documents='stream'")
    out = dict(batch, segment_ids=segment_ids(batch["x"], eos_id))
    if documents == "isolated":
        out["positions"] = document_positions(batch["x"], eos_id)
    return out


__all__ = ["annotate", "document_positions", "segment_ids"]
