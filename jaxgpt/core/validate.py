"""Host-side input checks shared by jaxgpt and torch_ref (NumPy only: no framework is imported).

Why they exist: a JAX gather clamps an out-of-range index (token id -1 reads row vocab-1, a
target -1 is scored as class vocab-1, an id >= vocab can give NaN logits) and
``dynamic_update_slice`` clamps its start (a full KV cache overwrites its last slots), all
without an error, and the train step is always jitted. So data is checked where it enters, on
the host, with NumPy arrays; the jit-safe counterparts live in ``jaxgpt.nn.checks`` (checkify).

Every check raises ONE ValueError naming the offending value, where it is and the limit.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig
from jaxgpt.core.constants import DOCUMENT_KEYS, IGNORE_INDEX, batch_keys


def int_at_least(name: str, value, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _first(bad: np.ndarray) -> tuple[int, ...]:
    """Index of the first True of ``bad`` (row-major)."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))


def _where(where: str | None) -> str:
    return f"{where}: " if where else ""


def _integers(a: np.ndarray, where: str | None, what: str) -> None:
    if a.dtype.kind not in "iu":
        raise ValueError(f"{_where(where)}{what}s must be integers, got dtype {a.dtype}")


def check_ids(ids, limit: int, *, where: str | None = None, what: str = "token id",
              space: str = "the vocabulary") -> None:
    """Every id in [0, limit), else ``<what> <v> is outside <space> [0, limit) at position (i, j)``."""
    a = np.asarray(ids)
    _integers(a, where, what)
    bad = (a < 0) | (a >= limit)
    if bad.any():
        pos = _first(bad)
        raise ValueError(f"{_where(where)}{what} {int(a[pos])} is outside {space} [0, {limit}) at position {pos}")


def check_targets(targets, n_classes: int, *, where: str | None = None, ignore_index: int = IGNORE_INDEX) -> None:
    """Targets in [0, n_classes) or equal to ``ignore_index`` (no loss), nothing else."""
    a = np.asarray(targets)
    _integers(a, where, "target")
    bad = ((a < 0) | (a >= n_classes)) & (a != ignore_index)
    if bad.any():
        pos = _first(bad)
        raise ValueError(f"{_where(where)}target {int(a[pos])} is outside [0, {n_classes}) and is not the ignore "
                         f"index {ignore_index} at position {pos}")


def check_padding_mask(mask, shape: Sequence[int], *, where: str = "attention_mask", values: bool = True) -> None:
    """A (B, T) padding mask: bool, or integers 0/1 (1 = real token), of the ids' shape.
    ``mask``: anything with .shape and .dtype (NumPy, JAX, a CPU torch tensor); ``values=False``
    checks only shape and dtype (a traced mask)."""
    if not hasattr(mask, "dtype"):
        mask = np.asarray(mask)
    check_mask_dtype(mask.dtype, where, allow_int=True)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(mask.shape)}, expected {tuple(shape)} like the ids")
    if values and str(mask.dtype).removeprefix("torch.") != "bool":
        a = np.asarray(mask)
        bad = (a != 0) & (a != 1)
        if bad.any():
            pos = _first(bad)
            raise ValueError(f"{where} value {int(a[pos])} is neither 0 (padding) nor 1 (real token) at position {pos}")


def check_mask_dtype(dtype, name: str = "mask", *, allow_int: bool = False) -> None:
    """Attention masks are boolean (True = attend); an additive float mask (0 / -inf) cast to bool
    would invert its meaning, so it is an error. ``dtype``: a NumPy/JAX dtype or a torch dtype."""
    kind = str(dtype).removeprefix("torch.")
    if kind == "bool" or (allow_int and kind.startswith(("int", "uint"))):
        return
    want = "bool or 0/1 integers" if allow_int else "bool"
    raise ValueError(f"{name} must be {want} (True = attend), got dtype {kind}; an additive float mask "
                     f"(0 / -inf) is not accepted: pass mask == 0 instead")


def check_mask(shape: Sequence[int], dtype, target: Sequence[int], name: str = "mask") -> None:
    """A boolean attention mask broadcastable to ``target`` = (B, H, Tq, Tk) without guessing:
    at most 4 dims, aligned from the right, each 1 or equal to the target's."""
    check_mask_dtype(dtype, name)
    shape, target = tuple(int(s) for s in shape), tuple(int(s) for s in target)
    ok = len(shape) <= 4 and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
    if not ok:
        raise ValueError(f"{name} has shape {shape}; expected a bool mask broadcastable to "
                         f"(B, H, Tq, Tk) = {target} (each dim 1 or equal, aligned from the right)")


def check_segment_ids(shape: Sequence[int], dtype, target: Sequence[int], name: str = "segment_ids") -> None:
    """Segment ids of packed documents: integers of shape ``target`` = (B, T), one id per token."""
    kind = str(dtype).removeprefix("torch.")
    if not kind.startswith(("int", "uint")):
        raise ValueError(f"{name} must be integer document ids, got dtype {kind}")
    if tuple(int(s) for s in shape) != tuple(int(t) for t in target):
        raise ValueError(f"{name} has shape {tuple(shape)}; expected (B, T) = {tuple(target)}, one id per token")


def overflow_message(cached: int, new: int, capacity: int) -> str:
    """The one wording of a KV cache overflow, in both frameworks."""
    return f"KV cache overflow: {cached} cached + {new} new > capacity {capacity}"


def check_cache_room(cached: int, new: int, capacity: int) -> None:
    if cached + new > capacity:
        raise ValueError(overflow_message(cached, new, capacity))


def _same_shape(a: dict, w: dict, key: str, like: str) -> None:
    if a[key].shape != a[like].shape:
        raise ValueError(f"{w[key]} has shape {a[key].shape}, expected {a[like].shape} like {w[like]}")


def check_batch(batch: dict, config) -> dict:
    """Validate a training/eval batch (NumPy arrays, any leading axes) for ``config``'s model
    before it reaches a jitted step: ids in the vocabulary, targets in [0, vocab) or the ignore
    index, class labels in [0, n_classes), padding masks bool or 0/1 of the ids' shape.
    Returns ``batch`` unchanged (so a call can wrap the step's argument)."""
    keys = batch_keys(config)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; a {type(config).__name__} batch has keys {list(keys)}")
    a = {k: np.asarray(batch[k]) for k in keys}
    w = {k: f"batch[{k!r}]" for k in keys}  # where, in the messages
    if isinstance(config, ModelConfig):
        check_ids(a["x"], config.vocab_size, where=w["x"])
        _same_shape(a, w, "y", "x")
        check_targets(a["y"], config.vocab_size, where=w["y"])
        for k in DOCUMENT_KEYS:
            if k in batch:
                a[k], w[k] = np.asarray(batch[k]), f"batch[{k!r}]"
                _same_shape(a, w, k, "x")
        if "positions" in batch:
            check_ids(a["positions"], config.max_len, where=w["positions"], what="position", space="the model's positions")
    elif isinstance(config, BertConfig):
        check_ids(a["input_ids"], config.encoder.vocab_size, where=w["input_ids"])
        check_padding_mask(a["attention_mask"], a["input_ids"].shape, where=w["attention_mask"])
        check_ids(a["labels"], config.n_classes, where=w["labels"], what="label", space="the classes")
    elif isinstance(config, EncDecConfig):
        check_ids(a["src"], config.encoder.vocab_size, where=w["src"])
        check_ids(a["tgt"], config.decoder.vocab_size, where=w["tgt"])
        check_padding_mask(a["src_mask"], a["src"].shape, where=w["src_mask"])
        _same_shape(a, w, "labels", "tgt")
        check_targets(a["labels"], config.decoder.vocab_size, where=w["labels"])
    else:
        raise TypeError(f"no batch layout for {type(config).__name__}")
    return batch
