"""Which kernel reads a paged cache in place (kv_layout 'pages'), per the platform the program is
lowered for (policy.py), never per the machine tracing it.

    paged kernel   cpu                           cuda                     tpu                        rocm
    'auto'         C++ kernel (paged_ffi.py)     Pallas kernel            Pallas TPU kernels: JAX's  the gather
                   where it takes the call:      (gpu_paged.py) where     decode kernel for T == 1   (kernels/paged.py)
                   float32 pages, built here;    it takes the call        where it takes the call
                   else the gather                                        (tpu_paged.py), else ours
                                                                          (tpu_ragged.py); else the gather
    'ffi'          C++ kernel                    refused                  refused                    refused
    'pallas'       Pallas kernel, interpreted    Pallas kernel            refused                    refused

The gather copies each row's pages into one array and attends over it: the same numbers, and the
portable path. 'pallas' on the CPU runs the CUDA kernel in Pallas' interpret mode: slow, exact, for
tests (the engine's greedy tokens with it equal transformers', test_gpu_paged.py). On a TPU a decode
step (T == 1) keeps JAX's tuned decode kernel where it takes the call (bfloat16 pools, head_dim % 128
== 0, no window): each query reads its pages once in either kernel, and JAX's reads several pages a
step; a prefill or mixed step, or pools it refuses, run tpu_ragged.py, which reads each page once
per block of queries where the decode kernel rereads it per query.
"""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from jaxgpt.nn.kernels import gpu_paged, paged_ffi, policy, tpu_paged, tpu_ragged
from jaxgpt.nn.kernels.paged import PAGED_KERNELS, Pages

__all__ = ["attend_pages"]


def _ffi_takes(q, k_pool) -> bool:
    return q.dtype == jnp.float32 and k_pool.dtype == jnp.float32 and paged_ffi.available()


def attend_pages(q, k_pool, v_pool, pages: Pages, *, scale, gathered: Callable, window=None):
    """Attention of q (B, T, H, D) over a paged cache's pools read in place by ``pages.kernel``'s
    kernel for the lowering platform; ``gathered(q, k_pool, v_pool)``: the gather path. A sliding
    ``window``: the C++ and the TPU ragged kernels take it; the CUDA kernel has none, so CUDA gathers."""
    table, q_pos, ks, vs, kernel = pages
    if kernel not in PAGED_KERNELS or kernel == "gather":
        raise ValueError(f"kv_layout='pages' reads the pools with one of {PAGED_KERNELS[:1] + PAGED_KERNELS[2:]}, "
                         f"got paged kernel {kernel!r}")

    def ffi(q, k, v):
        return paged_ffi.paged_attention(q, k, v, table, q_pos, scale=scale, window=window)

    def tpu(q, k, v):
        if q.shape[1] == 1 and window is None and tpu_paged.unsupported(q, k) is None:
            return tpu_paged.paged_attention(q, k, v, table, q_pos, scale=scale)
        return tpu_ragged.paged_attention(q, k, v, table, q_pos, ks, vs, scale=scale, window=window)

    def pallas(interpret: bool):
        return lambda q, k, v: gpu_paged.paged_attention(q, k, v, table, q_pos, ks, vs, scale=scale,
                                                         interpret=interpret)

    if kernel == "ffi":
        if not _ffi_takes(q, k_pool):
            raise ValueError(f"paged_kernel='ffi' reads float32 pages in a float32 model where the C++ kernel is "
                             f"built (got {q.dtype} queries, {k_pool.dtype} pages); use 'auto' or 'gather'")
        return ffi(*policy.require_cpu(q, k_pool, v_pool, what="paged_kernel='ffi'"))
    if kernel == "pallas":
        if window is not None:
            raise ValueError("paged_kernel='pallas' has no sliding window; use 'auto' or 'gather'")
        q, k_pool, v_pool = policy.require_platforms(q, k_pool, v_pool, what="paged_kernel='pallas'",
                                                     platforms=("cpu", "cuda"))
        return policy.by_platform(q, k_pool, v_pool, cpu=pallas(True), default=pallas(False))
    # int8 pools (with scales) fail the C++ kernel's dtype rule; the CUDA and TPU ragged kernels dequantise
    in_place = dict(cpu=ffi if _ffi_takes(q, k_pool) else gathered,
                    cuda=pallas(False) if window is None and gpu_paged.unsupported(q, k_pool) is None else gathered,
                    tpu=tpu if tpu_ragged.unsupported(q, k_pool) is None else gathered)
    return policy.by_platform(q, k_pool, v_pool, default=gathered, **in_place)
