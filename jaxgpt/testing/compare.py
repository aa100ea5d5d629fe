"""Comparing arrays and gradient trees at the parity tolerance, and the hook that reports each result.

The rule: float32 forward results agree to ``TOL`` (1e-5) max abs on unit-scale tensors. Gradients
summed over a batch are not unit scale (a norm scale's gradient reaches ~60), so each gradient leaf's
error is divided by max(1, max |reference leaf|) before the same bound applies.

Every comparison is handed to the listeners (``add_listener``) as a ``Comparison`` before it is
judged, so a test suite can keep a table of the worst error per component (parity_tests/plugins/report.py
does); with no listener installed the functions only compute and assert. Failures raise a plain
``AssertionError`` naming the component, the error and the tolerance (and the leaf, for trees).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxgpt.core.layout import to_numpy

TOL = 1e-5  # float32 forward and gradient tolerance, max abs on unit-scale tensors
KINDS = ("parity", "self")  # against an independent reference / an implementation against itself

to_np = to_numpy  # a NumPy array of a NumPy/JAX array or a torch tensor (half precision upcast to float32)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One judged error: ``component`` (the row it is reported under), ``err``, ``kind`` (one of
    ``KINDS``) and the ``tol`` it was held to."""

    component: str
    err: float
    kind: str = "parity"
    tol: float = TOL


_LISTENERS: list[Callable[[Any], None]] = []


def add_listener(listener: Callable[[Any], None]) -> None:
    """Call ``listener(event)`` for every comparison from now on: a ``Comparison``, or a
    ``jaxgpt.testing.reference.Float64Comparison`` from ``assert_as_accurate_as_torch``."""
    _LISTENERS.append(listener)


def remove_listener(listener: Callable[[Any], None]) -> None:
    _LISTENERS.remove(listener)


@contextlib.contextmanager
def listening(listener: Callable[[Any], None]) -> Iterator[None]:
    """``add_listener`` for the duration of a ``with`` block."""
    add_listener(listener)
    try:
        yield
    finally:
        remove_listener(listener)


def emit(event: Any) -> None:
    """Hand ``event`` to every listener."""
    for listener in tuple(_LISTENERS):
        listener(event)


def record(component: str, err: float, kind: str = "parity", tol: float = TOL) -> float:
    """Report ``err`` under ``component`` to the listeners (nothing is asserted). Returns ``err``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    emit(Comparison(component, float(err), kind, tol))
    return float(err)


@contextlib.contextmanager
def located(where: str) -> Iterator[None]:
    """Append ``where`` (a leaf path, an input) to the message of an AssertionError raised inside."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e} [{where}]") from None


def max_err(a, b) -> float:
    """max |a - b| in float64 (0 for empty arrays); the shapes must match."""
    a, b = np.asarray(to_np(a), np.float64), np.asarray(to_np(b), np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def scaled_err(a, ref, unit_scale: bool = True) -> float:
    """``max_err(a, ref)``, divided by max(1, max |ref|) when ``unit_scale``."""
    err = max_err(a, ref)
    ref = to_np(ref)
    if unit_scale and np.size(ref):
        err /= max(1.0, float(np.max(np.abs(ref))))
    return err


def assert_close(a, b, component: str, tol: float = TOL, unit_scale: bool = False, kind: str = "parity") -> float:
    """max |a - b| <= tol, with ``b`` the reference; reported under ``component`` in the ``kind``
    table ('parity': ``b`` is an independent reference; 'self': the same code another way).

    unit_scale: divide the error by max(1, max |b|) first (the gradient rule). Returns the error.
    """
    err = record(component, scaled_err(a, b, unit_scale), kind, tol)
    scaled = " (divided by max(1, max|ref|))" if unit_scale else ""
    assert err <= tol, f"{component}: max abs error {err:.3e}{scaled} > tolerance {tol:.2g}"
    return err


def assert_self_consistent(a, b, component: str, tol: float = TOL, unit_scale: bool = False) -> float:
    """``assert_close`` for a self-consistency check (cache vs none, jit vs eager, ...): its own table."""
    return assert_close(a, b, component, tol, unit_scale, kind="self")


# -- trees -----------------------------------------------------------------------------------------
def leaf_name(path) -> str:
    """'a/b/kernel' for a ``jax.tree_util`` key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _at(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", getattr(k, "idx", k))]
    return tree


def leaf_errors(tree, ref_tree) -> dict[str, float]:
    """{'a/b/kernel': max |g - g_ref| / max(1, max |g_ref|)} for every non-empty leaf of ``tree``
    against the leaf at the same path of ``ref_tree`` (the gradient rule; nothing reported)."""
    return {leaf_name(path): scaled_err(leaf, _at(ref_tree, path))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if np.size(leaf)}


def grads_err(tree, ref_tree) -> float:
    """The worst per-leaf error of ``leaf_errors`` (0 for an empty tree)."""
    return max(leaf_errors(tree, ref_tree).values(), default=0.0)


def assert_grads_close(tree, ref_tree, component: str, tol: float = TOL, kind: str = "parity") -> float:
    """The gradient rule, leaf by leaf: every leaf of ``tree`` against the leaf at the same path of
    ``ref_tree``, error / max(1, max |ref leaf|) <= tol; a failure names the leaf. Returns the worst."""
    worst = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        with located(f"leaf {leaf_name(path)}"):
            worst = max(worst, assert_close(leaf, _at(ref_tree, path), component, tol, unit_scale=True, kind=kind))
    return worst


__all__ = ["KINDS", "TOL", "Comparison", "add_listener", "assert_close", "assert_grads_close", "assert_self_consistent",
           "emit", "grads_err", "leaf_errors", "leaf_name", "listening", "located", "max_err", "record",
           "remove_listener", "scaled_err", "to_np"]
