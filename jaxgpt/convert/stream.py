"""Checkpoints read and written a tensor at a time: safetensors files memory-mapped, never read whole.

- ``open_safetensors(path)``: ``{name: np.memmap}`` from the file's header alone. ``load_hf`` hands
  these views to the family converters (renames, transposes and splits stay views) and the strict
  rule copies each once into the params' preallocated arrays (``jaxgpt.core.mapped.copy_into``):
  a load holds the params plus about one chunk, bf16 stays bf16, and casts cost no extra copy.
- ``sharded_template(template, shardings)``: template leaves that assemble a ``jax.Array`` with
  ``jax.make_array_from_callback``, each callback reading only its device's slice of the mapped
  file (``read``), so a host materialises only the shards its devices hold.
- ``write_shards``: ``save_hf``'s files, written a chunk of rows at a time (``write_safetensors``:
  each tensor cast to the export dtype and laid out through one small buffer), so a save holds
  the params plus about one chunk.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jaxgpt.core.layout import fill
from jaxgpt.core.mapped import copy_into, write_rows

# safetensors dtype names -> NumPy (ml_dtypes for bf16 / fp8, imported where used)
_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def open_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """``{tensor name: read-only np.memmap}`` of a safetensors file; reads only its header.
    A header that does not describe the file (an unknown dtype, offsets outside the data, a byte
    count that does not match the shape) is a ValueError naming the tensor."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with NumPy)

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{str(path)!r} is not a safetensors file: header length {n} for a {size}-byte file")
        header = json.loads(f.read(n))
    start, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _NUMPY:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {info.get('dtype')!r}; readable: {sorted(_NUMPY)}")
        dtype, shape = np.dtype(_NUMPY[info["dtype"]]), tuple(info["shape"])
        lo, hi = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if hi - lo != count * dtype.itemsize or start + hi > size or lo < 0:
            raise ValueError(f"{str(path)!r}: tensor {name!r} ({info['dtype']} {list(shape)}) has data_offsets "
                             f"{[lo, hi]}, which do not hold {count * dtype.itemsize} bytes inside the file's "
                             f"{size - start} data bytes")
        out[name] = (np.memmap(path, dtype, "r", offset=start + lo, shape=(count,)).reshape(shape) if count
                     else np.zeros(shape, dtype))
    return out


# -- sharded load -----------------------------------------------------------------------------
def read(source: np.ndarray, index: tuple) -> np.ndarray:
    """The part of a (memory-mapped) source one device holds: a view, read when copied."""
    return source[index]


def _length(s: slice, n: int) -> int:
    return len(range(n)[s])


class ShardedLeaf:
    """A template leaf (shape, dtype) whose array is built shard by shard on ``sharding``."""

    def __init__(self, shape: tuple, dtype, sharding):
        self.shape, self.dtype, self.sharding = tuple(shape), np.dtype(dtype), sharding

    def assemble(self, pieces: Mapping[int | None, np.ndarray]):
        """``pieces``: ``{None: whole}`` or ``{i: layer i}`` (views, checked by the strict rule)."""
        import jax

        def shard(index: tuple) -> np.ndarray:  # index: one slice per dimension of self.shape
            index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
            out = np.empty(tuple(_length(s, n) for s, n in zip(index, self.shape)), self.dtype)
            if None in pieces:
                copy_into(out, read(pieces[None], index))
            else:  # a stacked leaf: the layers of this shard, each one's slice
                for j, i in enumerate(range(self.shape[0])[index[0]]):
                    copy_into(out[j], read(pieces[i], index[1:]))
            return out

        return jax.make_array_from_callback(self.shape, self.sharding, shard)


def sharded_template(template: Mapping, shardings: Mapping) -> dict:
    """``template`` (ShapeDtypeStructs) with each leaf placed on its ``shardings`` leaf (the same tree)."""
    if isinstance(template, Mapping):
        missing = sorted(set(template) - set(shardings))
        if missing:
            raise ValueError(f"shardings has no entry for {missing}; it must match the params tree")
        return {k: sharded_template(v, shardings[k]) for k, v in template.items()}
    return ShardedLeaf(template.shape, template.dtype, shardings)


# -- streaming save ---------------------------------------------------------------------------
def contiguous(a: Any, dtype: np.dtype) -> np.ndarray:
    """A new C-contiguous copy of ``a`` (a view of a param, maybe transposed) in ``dtype``."""
    a = np.asarray(a)
    return fill({None: a}, a.shape, dtype)


def plan_shards(sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Names in sorted order, cut into shards of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(sizes):
        if shards[-1] and size + sizes[key] > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += sizes[key]
    return shards


def write_safetensors(path: Path, views: Mapping[str, Any], dtype: np.dtype, metadata: Mapping[str, str]) -> None:
    """One safetensors file of ``views`` (all written in ``dtype``): the header first, then each
    tensor, cast and laid out a chunk of rows at a time (``write_rows``). The bytes are safetensors'
    ``save_file``'s for tensors of one dtype: compact JSON, names in sorted order, the header padded
    with spaces to a multiple of 8."""
    kind = {v: k for k, v in _NUMPY.items()}[dtype.name]
    header, offset = {"__metadata__": dict(metadata)}, 0
    for name in sorted(views):
        shape = [int(n) for n in np.shape(views[name])]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": kind, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in sorted(views):
            write_rows(f, views[name], dtype)


def write_shards(path: Path, views: Mapping[str, Any], dtype: np.dtype, limit: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json,
    one chunk of a tensor in memory at a time."""
    sizes = {k: int(np.prod(np.shape(v), dtype=np.int64)) * dtype.itemsize for k, v in views.items()}
    shards = plan_shards(sizes, limit)
    meta = {"format": "pt"}  # transformers only loads safetensors files marked as torch ('pt') ones
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, keys in zip(names, shards):
        write_safetensors(path / name, {k: views[k] for k in keys}, dtype, meta)
    if len(shards) > 1:
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
