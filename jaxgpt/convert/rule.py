"""Weights between jaxgpt (Flax params) and torch-style state dicts, on NumPy arrays.

The generic rule, used for torch_ref (whose attribute names equal jaxgpt's module names):
  Flax path                      torch key
  a/b_3/c/kernel (in, out)   <-> a.b.3.c.weight (out, in)   transposed once, here
  a/embed/embedding          <-> a.embed.weight
  a/norm/scale, .../bias     <-> a.norm.scale, ....bias     unchanged
A module stacked by ``nn.scan`` (one leaf with a leading layer axis), named in ``stacked`` by its
Flax path ('layers', 'encoder/layers'), maps to ``name.{i}.…``.
Conversion is strict: every missing, unexpected or mis-shaped key is named in one ValueError.
This module never imports torch: tensors are read through ``.detach().cpu().numpy()`` if present.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import numpy as np
from flax import traverse_util

_INDEXED = re.compile(r"^(.*)_(\d+)$")


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy of a NumPy/JAX array or a torch tensor (without importing torch)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.array(x)


def _module_key(name: str) -> str:
    m = _INDEXED.match(name)
    return f"{m.group(1)}.{m.group(2)}" if m else name


def _leaf_rule(leaf: str, ndim: int) -> tuple[str, bool]:
    """(torch leaf name, transpose?) for a Flax leaf name."""
    if leaf == "kernel":
        if ndim != 2:
            raise ValueError(f"only 2-D Dense kernels are supported, got a {ndim}-D kernel")
        return "weight", True
    if leaf == "embedding":
        return "weight", False
    return leaf, False


def _rules(template: Mapping, stacked: Iterable[str]):
    """Yield (flax path, torch key, transpose, layer index or None, per-layer shape).

    ``stacked`` names scanned modules by their Flax path ('layers', 'encoder/layers'): their
    leaves carry a leading layer axis, and layer i becomes '<path>.{i}.…' in torch keys.
    """
    stacked = set(stacked)
    for path, leaf in traverse_util.flatten_dict(dict(template)).items():
        depth = next((k for k in range(1, len(path)) if "/".join(path[:k]) in stacked), 0)
        shape = tuple(leaf.shape)[1:] if depth else tuple(leaf.shape)
        name, transpose = _leaf_rule(path[-1], len(shape))
        mods = [_module_key(p) for p in path[:-1]]
        if depth:
            for i in range(leaf.shape[0]):
                yield path, ".".join(mods[:depth] + [str(i)] + mods[depth:] + [name]), transpose, i, shape
        else:
            yield path, ".".join(mods + [name]), transpose, None, shape


def params_to_state_dict(params: Mapping, *, stacked: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Flax params -> {torch key: NumPy array} by the generic rule (see module docstring)."""
    out: dict[str, np.ndarray] = {}
    flat = traverse_util.flatten_dict(dict(params))
    for path, key, transpose, i, _ in _rules(params, stacked):
        a = to_numpy(flat[path])
        a = a if i is None else a[i]
        out[key] = np.ascontiguousarray(a.T) if transpose else a
    return out


def state_dict_to_params(state_dict: Mapping[str, Any], template: Mapping, *,
                         stacked: Iterable[str] = ()) -> dict:
    """{torch key: array} -> Flax params shaped like ``template`` (params or eval_shape output).

    Raises ValueError naming every missing, unexpected and mis-shaped key.
    """
    sd = {k: v for k, v in state_dict.items()}
    used, missing, bad = set(), [], []
    pieces: dict[tuple, dict[int | None, np.ndarray]] = {}
    for path, key, transpose, i, shape in _rules(template, stacked):
        if key not in sd:
            missing.append(key)
            continue
        used.add(key)
        a = to_numpy(sd[key])
        a = a.T if transpose else a
        if a.shape != shape:
            bad.append(f"{key}: got {tuple(to_numpy(sd[key]).shape)}, expected "
                       f"{tuple(reversed(shape)) if transpose else shape}")
            continue
        pieces.setdefault(path, {})[i] = a
    unexpected = sorted(set(sd) - used)
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing keys {sorted(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if bad:
            parts.append(f"shape mismatches {bad}")
        raise ValueError("state dict does not match the model: " + "; ".join(parts))
    flat_template = traverse_util.flatten_dict(dict(template))
    flat = {}
    for path, by_layer in pieces.items():
        if None in by_layer:
            arr = by_layer[None]
        else:
            arr = np.stack([by_layer[i] for i in range(len(by_layer))])
        flat[path] = np.ascontiguousarray(arr, dtype=np.dtype(flat_template[path].dtype))
    return traverse_util.unflatten_dict(flat)
