"""Copying out of memory-mapped tensors (``np.memmap`` and views of one) cheaply: framework-free.

``copy_into(dst, src)`` is the one copy of a streaming load (jaxgpt/convert/stream.py): the cast to
dst's dtype and a transpose fused into it. A view that covers one byte range of its file (a whole
tensor, maybe transposed) is read with ``readinto`` a chunk of rows at a time into one small
buffer, which stays in cache while it is copied, instead of page faults on the map, which cost the
kernel several times more; any other view (a device's slice of a tensor) is read through the map,
whose pages are then dropped from the process (the file stays in the page cache). A load keeps
resident the params it builds plus a chunk.

New arrays of 4 MiB and more (``empty``) come from an anonymous map in the kernel's 4 KiB pages:
NumPy asks for transparent huge pages on such arrays, and on a busy host whose memory is
fragmented the kernel compacts memory to find them while the copy waits.
"""
from __future__ import annotations

import mmap

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds  # NumPy >= 2
except ImportError:  # NumPy 1.x
    byte_bounds = np.byte_bounds

_PAGED = 1 << 22  # NumPy's own threshold for asking for huge pages
_CHUNK = 1 << 20  # bytes of source rows read at a time: they stay in cache while copied out
_BLOCK = 16  # columns per step of a transposed copy: the 16 source rows it reads stay in cache


def empty(shape: tuple, dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``; from 4 MiB up, in 4 KiB pages (an anonymous map, freed with the array)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _PAGED:
        return np.empty(shape, dtype)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # plain process memory, not shmem
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=private) if private else mmap.mmap(-1, nbytes), dtype).reshape(shape)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` cast to dst's dtype (bf16/fp16 -> float32 is exact); ``src`` a NumPy array
    of dst's shape, memory-mapped or not: a torch (out, in) weight read as (in, out) is a
    transposed view, copied a block of columns at a time."""
    where = _file_range(src)
    flipped = src.ndim == 2 and src.strides[0] < src.strides[1]
    if where is None or src.ndim == 0 or not (dst.flags.c_contiguous or flipped):
        cast_copy(dst, src)
        release(src)
        return
    stored = src.T if flipped else src.reshape(len(src), -1)  # the rows as the file holds them
    rows = dst if flipped else dst.reshape(stored.shape)  # a view: dst is C-contiguous here
    step = max(1, _CHUNK // max(1, stored[0].nbytes))
    buf = np.empty((min(step, len(stored)),) + stored.shape[1:], stored.dtype)
    with open(where[0], "rb", buffering=0) as f:
        f.seek(where[1])
        for r in range(0, len(stored), step):
            part = buf[:min(step, len(stored) - r)]
            _read(f, part)
            if flipped:
                cast_copy(rows[:, r:r + len(part)], part.T)
            else:
                cast_copy(rows[r:r + len(part)], part)


def cast_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` cast to dst's dtype; a transposed source a block of columns at a time."""
    if src.ndim == 2 and src.strides[0] < src.strides[1]:
        for j in range(0, src.shape[1], _BLOCK):
            np.copyto(dst[:, j:j + _BLOCK], src[:, j:j + _BLOCK], casting="unsafe")
    else:
        np.copyto(dst, src, casting="unsafe")


def _read(f, out: np.ndarray) -> None:
    view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{f.name!r} ended {len(view) - done} bytes early, inside a tensor")
        done += n


def write_rows(f, a: np.ndarray, dtype) -> None:
    """Write ``a`` (any view: transposed, a layer of a stack) to the binary file ``f`` in C order as
    ``dtype``, a 1 MiB chunk of rows at a time through one buffer (the save's mirror of copy_into)."""
    a, dtype = np.asarray(a), np.dtype(dtype)
    rows = a if a.ndim == 2 else a.reshape(len(a) if a.ndim else 1, -1)
    step = max(1, _CHUNK // max(1, rows.shape[1] * dtype.itemsize))
    buf = np.empty((min(step, len(rows)), rows.shape[1]), dtype)
    for r in range(0, len(rows), step):
        part = buf[:min(step, len(rows) - r)]
        cast_copy(part, rows[r:r + len(part)])
        f.write(part.reshape(-1).view(np.uint8).data)


def release(a: np.ndarray) -> None:
    """Drop the pages of ``a``'s memory map (a ``np.memmap`` or a view of one) from this process's
    memory; reading it again faults them back in from the page cache. Anything else: nothing."""
    mm = getattr(a, "_mmap", None)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):  # the flag is per platform
        mm.madvise(mmap.MADV_DONTNEED)


def _file_range(a: np.ndarray) -> tuple[str, int] | None:
    """(file name, offset of the first byte) of a memory-mapped view whose bytes are one contiguous
    range of its file, in C order or transposed (2-D); None for anything else."""
    mm = getattr(a, "_mmap", None)
    if not isinstance(mm, mmap.mmap) or a.size == 0 or getattr(a, "filename", None) is None:
        return None
    if not (a.flags.c_contiguous or (a.ndim == 2 and a.T.flags.c_contiguous)):
        return None  # a strided slice: only its own pages, through the map
    lo, _ = byte_bounds(a)
    base = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]  # where the map starts
    first = a.offset - a.offset % mmap.ALLOCATIONGRANULARITY  # the file offset np.memmap mapped from
    return a.filename, first + lo - base
