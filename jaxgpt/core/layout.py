"""The framework-free layout shared by jaxgpt and torch_ref: NumPy and the configs only.

Both frameworks (and the converters) need the same few facts about how parameters are laid out,
and torch_ref must not import JAX or Flax to learn them, so they live here:

- the generic state-dict rule between Flax params and torch_ref state dicts (re-exported by
  ``jaxgpt.convert.rule`` / ``jaxgpt.convert``):

      Flax path                      torch key
      a/b_3/c/kernel (in, out)   <-> a.b.3.c.weight (out, in)   transposed once, here
      a/embed/embedding          <-> a.embed.weight
      a/norm/scale, .../bias     <-> a.norm.scale, ....bias     unchanged

  A module stacked by ``nn.scan`` (one leaf with a leading layer axis), named in ``stacked`` by
  its Flax path ('layers', 'encoder/layers'), maps to ``name.{i}.…``. Conversion is strict:
  every missing, unexpected or mis-shaped key is named in one ValueError. Params are nested
  mappings (dict, FrozenDict) walked here directly, so no ``jax.tree_util`` is needed.
- ``stacked_paths(config, execution)``: the Flax paths of the scanned layer stacks (re-exported by
  ``jaxgpt.models``), and ``relayout``, which moves params (and optimizer states) between the
  stacked and the separate-layers layout (``Execution.scan_layers``);
- ``key_eps`` and ``seal_schedule``: the Attention Residuals layout (re-exported by
  ``jaxgpt.nn.attnres``).

Half precision: torch bfloat16/float16 tensors and NumPy/ml_dtypes float16/bfloat16 arrays are
accepted everywhere an array is read (``to_numpy``) and upcast explicitly to float32, which is
exact (every bf16/fp16 value is a float32 value); ``state_dict_to_params`` then casts to the
template's dtype, so a float32 template receives exactly the float32 upcast.

Streaming: ``state_dict_to_params`` takes NumPy views (memory-mapped tensors, their transposes and
slices) as they are and copies each once into the leaf's preallocated array, the transpose and
the cast fused into that copy (``jaxgpt.core.mapped.copy_into``). A template leaf with an
``assemble(pieces)`` method builds its own array from the checked views (the sharded load in
jaxgpt/convert/stream.py).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig, Execution, ModelConfig
from jaxgpt.core.mapped import copy_into, empty

_INDEXED = re.compile(r"^(.*)_(\d+)$")
ENCDEC_STACKED = ("encoder/layers", "decoder/layers")  # the encoder-decoder's scanned stacks


# -- arrays ------------------------------------------------------------------------------------
def _is_half(dtype: np.dtype) -> bool:
    """float16, or an ml_dtypes low-precision float (bfloat16, float8_*: NumPy kind 'V')."""
    return (dtype.kind == "f" and dtype.itemsize < 4) or dtype.name == "bfloat16" or dtype.name.startswith("float8")


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy of a NumPy/JAX array or a torch tensor (torch is never imported).

    Half-precision floats (torch bf16/fp16, NumPy fp16, ml_dtypes bf16) come back as float32:
    torch bf16 tensors have no ``.numpy()``, and the upcast is exact.
    """
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if x.is_floating_point() and x.element_size() < 4:
            x = x.float()
        x = x.numpy()
    a = np.array(x)
    return a.astype(np.float32) if _is_half(a.dtype) else a


# -- nested params ---------------------------------------------------------------------------
def flatten(tree: Mapping, prefix: tuple = ()) -> dict[tuple[str, ...], Any]:
    """{('a', 'b', 'kernel'): leaf} for nested mappings, in insertion order; empty mappings vanish."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


# -- the generic rule -----------------------------------------------------------------------
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


def _rules(template: Mapping, stacked: Iterable[str]) -> Iterator[tuple]:
    """Yield (flax path, torch key, transpose, layer index or None, per-layer shape).

    ``stacked`` names scanned modules by their Flax path ('layers', 'encoder/layers'): their
    leaves carry a leading layer axis, and layer i becomes '<path>.{i}.…' in torch keys.
    """
    stacked = set(stacked)
    for path, leaf in flatten(template).items():
        depth = next((k for k in range(1, len(path)) if "/".join(path[:k]) in stacked), 0)
        shape = tuple(leaf.shape)[1:] if depth else tuple(leaf.shape)
        name, transpose = _leaf_rule(path[-1], len(shape))
        mods = [_module_key(p) for p in path[:-1]]
        if depth:
            for i in range(leaf.shape[0]):
                yield path, ".".join(mods[:depth] + [str(i)] + mods[depth:] + [name]), transpose, i, shape
        else:
            yield path, ".".join(mods + [name]), transpose, None, shape


def params_to_state_dict(params: Mapping, *, stacked: Iterable[str] = (),
                         views: bool = False) -> dict[str, np.ndarray]:
    """Flax params -> {torch key: NumPy array} by the generic rule (see module docstring).
    Half-precision leaves come out as float32 (``to_numpy``). ``views=True``: NumPy views of the
    params in their own dtype instead (layer slices and transposes not copied), for a caller that
    copies them a few at a time (a streaming save)."""
    out: dict[str, np.ndarray] = {}
    flat = flatten(params)
    for path, key, transpose, i, _ in _rules(params, stacked):
        a = np.asarray(flat[path]) if views else to_numpy(flat[path])
        a = a if i is None else a[i]
        out[key] = (a.T if views else np.ascontiguousarray(a.T)) if transpose else a
    return out


def state_dict_to_params(state_dict: Mapping[str, Any], template: Mapping, *,
                         stacked: Iterable[str] = ()) -> dict:
    """{torch key: array} -> Flax params shaped like ``template`` (params or eval_shape output).

    Values may be torch tensors (any device, bf16/fp16 included) or NumPy arrays: each is read
    through ``to_numpy`` (half precision upcast exactly to float32) and then cast to the
    template leaf's dtype. Raises ValueError naming every missing, unexpected and mis-shaped key.
    """
    sd = dict(state_dict.items())
    used, missing, bad = set(), [], []
    pieces: dict[tuple, dict[int | None, np.ndarray]] = {}
    for path, key, transpose, i, shape in _rules(template, stacked):
        if key not in sd:
            missing.append(key)
            continue
        used.add(key)
        got = sd[key] if isinstance(sd[key], np.ndarray) else to_numpy(sd[key])  # views stay views until copied
        a = got.T if transpose else got
        if a.shape != shape:
            bad.append(f"{key}: got {got.shape}, expected "
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
    flat_template = flatten(template)
    flat = {}
    for path, by_layer in pieces.items():
        leaf = flat_template[path]
        assemble = getattr(leaf, "assemble", None)
        flat[path] = assemble(by_layer) if assemble is not None else fill(by_layer, leaf.shape, leaf.dtype)
    return unflatten(flat)


def fill(pieces: Mapping[int | None, np.ndarray], shape: tuple, dtype) -> np.ndarray:
    """One new array of ``shape`` and ``dtype`` from checked pieces: ``{None: whole}``, or
    ``{i: layer i}`` for a stacked leaf, each copied once (``copy_into``) into its place."""
    out = empty(tuple(shape), dtype)
    for i, a in pieces.items():
        copy_into(out if i is None else out[i], a if isinstance(a, np.ndarray) else to_numpy(a))
    return out


# -- model layouts --------------------------------------------------------------------------
def stacked_paths(config: ModelConfig | BertConfig | EncDecConfig, execution: Execution | None = None) -> tuple[str, ...]:
    """Flax paths of the ``nn.scan`` layer stacks (the converter's ``stacked=``) of ``config`` run
    with ``execution`` (None: ``Execution.for_model(config)``). Unscanned stacks
    (``scan_layers=False``, AttnRes) are separate modules ``layers_0, layers_1, ...``, which the
    generic rule maps to the same ``layers.{i}.…`` keys without help."""
    if not Execution.for_model(config, execution).scan_layers:
        return ()
    if isinstance(config, EncDecConfig):
        return ENCDEC_STACKED
    if isinstance(config, BertConfig):
        config = config.encoder
    return () if config.residual != "standard" else ("layers",)


def relayout(tree: Any, config: ModelConfig | BertConfig | EncDecConfig, *, scanned: bool, stack=np.stack) -> Any:
    """``tree`` (params, or any pytree holding params-shaped dicts: an optimizer state) with ``config``'s
    layer stacks moved to the layout of ``Execution(scan_layers=scanned)``: scanned, each
    ``{name}_0 ... {name}_{L-1}`` becomes one ``name`` whose leaves gain a leading layer axis
    (``stack``: np.stack, or jnp.stack for device arrays); else the reverse. Each dict met outside a
    dict is a params root (optax keeps its moments in such trees); stacks already in place pass."""
    stacks = dict(zip(stacked_paths(config, Execution(scan_layers=True)), _layer_counts(config)))

    def root(node, prefix):
        if isinstance(node, Mapping):
            out = {k: root(v, prefix + (k,)) for k, v in node.items()}
            for path, n in stacks.items():
                *parent, name = path.split("/")
                if tuple(parent) == prefix:
                    out = _stacked(out, name, n, stack) if scanned else _separate(out, name, n)
            return out
        return node

    def outside(node):
        if isinstance(node, Mapping):
            return root(node, ())
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # a NamedTuple: optax's states
            return type(node)(*(outside(v) for v in node))
        if isinstance(node, (list, tuple)):
            return type(node)(outside(v) for v in node)
        return node

    return outside(tree)


def _layer_counts(config) -> tuple[int, ...]:
    if isinstance(config, EncDecConfig):
        return config.encoder.n_layer, config.decoder.n_layer
    return (getattr(config, "encoder", config).n_layer,)


def _map(f, tree):
    """f over the array leaves of nested mappings and tuples (framework-free tree map)."""
    if isinstance(tree, Mapping):
        return {k: _map(f, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(f, v) for v in tree))
    return f(tree) if hasattr(tree, "shape") else tree


def _separate(node: dict, name: str, n: int) -> dict:
    if name not in node:
        return node
    layers = node.pop(name)
    node.update({f"{name}_{i}": _map(lambda a, i=i: a[i], layers) for i in range(n)})
    return node


def _stacked(node: dict, name: str, n: int, stack) -> dict:
    if f"{name}_0" not in node:
        return node
    layers = [node.pop(f"{name}_{i}") for i in range(n)]
    flat = [flatten(layer) for layer in layers]  # a leaf without a shape (optax's MaskedNode) is kept once
    node[name] = unflatten({k: stack([f[k] for f in flat]) if hasattr(flat[0][k], "shape") else flat[0][k]
                            for k in flat[0]})
    return node


def key_eps(config: ModelConfig) -> float:
    """eps of the AttnRes key RMSNorm: ``attnres_eps``, or the model's ``norm_eps`` if None."""
    return config.norm_eps if config.attnres_eps is None else config.attnres_eps


def seal_schedule(config: ModelConfig) -> tuple[str | None, ...]:
    """Per layer: after which sublayer ('attn' | 'mlp') the partial AttnRes block is sealed, or None."""
    cfg, n = config, config.n_layer
    if cfg.residual == "full_attnres":
        return (None,) * n
    if cfg.residual != "block_attnres":
        raise ValueError(f"AttnRes needs residual='full_attnres' or 'block_attnres', got {cfg.residual!r}")
    size = max(1, n // cfg.attnres_blocks)  # layers per block
    if cfg.attnres_variant == "seed":
        return tuple("attn" if (i + 1) % size == 0 else None for i in range(n))
    return tuple("mlp" if (i + 1) % size == 0 and (i + 1) // size < cfg.attnres_blocks and i < n - 1 else None
                 for i in range(n))
