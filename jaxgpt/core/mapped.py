"""Copying out of memory-mapped tensors (``np.memmap`` and views of one) cheaply: framework-free.

``copy_into(dst, src)`` is the one copy of a streaming load (jaxgpt/convert/stream.py): the cast to
dst's dtype and a transpose fused into it. A view that covers one byte range of its file (a whole
tensor, maybe transposed) is read with one ``readinto`` instead of page faults on the map, which
costs the kernel a fraction of the time; any other view (a device's slice of a tensor) is read
through the map, and the map's pages are then dropped from the process (the file stays in the page
cache), so a load keeps resident the params it builds plus about one tensor.
"""
from __future__ import annotations

import mmap

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds  # NumPy >= 2
except ImportError:  # NumPy 1.x
    byte_bounds = np.byte_bounds

_BLOCK = 16  # columns per step of a transposed copy: the 16 source rows it reads stay in cache


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` cast to dst's dtype (bf16/fp16 -> float32 is exact); ``src`` a NumPy array
    of dst's shape, memory-mapped or not. A transposed source (a torch (out, in) weight read as
    (in, out)) is copied a block of columns at a time, so each block reads a few whole source rows."""
    read = _read_whole(src)
    if read.ndim == 2 and read.strides[0] < read.strides[1]:
        for j in range(0, read.shape[1], _BLOCK):
            np.copyto(dst[:, j:j + _BLOCK], read[:, j:j + _BLOCK], casting="unsafe")
    else:
        np.copyto(dst, read, casting="unsafe")
    if read is src:
        release(src)


def release(a: np.ndarray) -> None:
    """Drop the pages of ``a``'s memory map (a ``np.memmap`` or a view of one) from this process's
    memory; reading it again faults them back in from the page cache. Anything else: nothing."""
    mm = getattr(a, "_mmap", None)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):  # the flag is per platform
        mm.madvise(mmap.MADV_DONTNEED)


def _read_whole(a: np.ndarray) -> np.ndarray:
    """A memory-mapped view whose bytes are one contiguous range of its file, read into new memory
    with one ``readinto`` and viewed the same way (shape, strides); anything else: ``a`` itself."""
    mm = getattr(a, "_mmap", None)
    if not isinstance(mm, mmap.mmap) or a.size == 0 or getattr(a, "filename", None) is None:
        return a
    lo, hi = byte_bounds(a)
    if hi - lo != a.nbytes:  # a strided slice: only its own pages, through the map
        return a
    base = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]  # where the map starts
    first = a.offset - a.offset % mmap.ALLOCATIONGRANULARITY  # the file offset np.memmap mapped from
    buf = np.empty(hi - lo, np.uint8)
    with open(a.filename, "rb", buffering=0) as f:
        f.seek(first + lo - base)
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{a.filename!r} ended {len(buf) - done} bytes early, inside a tensor")
            done += n
    return np.ndarray(a.shape, a.dtype, buffer=buf, offset=a.__array_interface__["data"][0] - lo, strides=a.strides)
