"""The grouped matmul of MoE's 'grouped' path (nn/moe.py): megablox's Pallas TPU kernel
(``jax.experimental.pallas.ops.tpu.megablox.gmm``) in a program lowered for a TPU, and
``jax.lax.ragged_dot`` (the portable grouped matmul, same math) everywhere else (policy.on_tpu).

gmm multiplies lhs rows [start_i, start_i + sizes[i]) by rhs[i], tiling the rows by ``tm``, the
contraction by ``tk`` and the output columns by ``tn``; its backward pass is two more grouped
kernels (gmm, tgmm). ``unsupported`` is the one rule for the shapes it takes. Under a mesh each
device runs the whole grouped matmul (policy.replicated): the pairs are sorted by expert over the
whole batch, so a device's rows are no group of their own. On the CPU it runs
only in TPU interpret mode, which is how the tests check its numbers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgpt.nn.kernels import policy

__all__ = ["grouped_dot", "tiling", "unsupported"]

_ROW_TILES = (128, 64, 32, 16)  # the largest that divides the rows (none measured on a TPU)


def tiling(m: int, k: int, n: int) -> tuple[int, int, int] | None:
    """(tm, tk, tn) for lhs (m, k) and rhs (G, k, n): rows by the largest of _ROW_TILES dividing m;
    k and n whole up to 128, else by 128 lanes (the kernel masks a last partial tile). None: no row tile."""
    tm = next((t for t in _ROW_TILES if m % t == 0), None)
    return None if tm is None else (tm, min(k, 128), min(n, 128))


def unsupported(lhs, rhs) -> str | None:
    """Why megablox's gmm cannot take lhs (m, k) @ rhs (G, k, n) (None: it can)."""
    if lhs.dtype not in (jnp.float32, jnp.bfloat16) or rhs.dtype != lhs.dtype:
        return f"it multiplies float32 or bfloat16 operands of one dtype (got {lhs.dtype} and {rhs.dtype})"
    if tiling(*lhs.shape, rhs.shape[2]) is None:
        return f"its row tile must divide the {lhs.shape[0]} rows (one of {_ROW_TILES})"
    return policy.pallas_unsupported()


def gmm(lhs, rhs, sizes):
    """megablox's grouped matmul: lhs (m, k), rhs (G, k, n), sizes (G,) int32 summing to m -> (m, n)."""
    from jax.experimental.pallas.ops.tpu.megablox import ops  # Pallas: imported where used

    return ops.gmm(lhs, rhs, sizes.astype(jnp.int32), lhs.dtype, tiling(*lhs.shape, rhs.shape[2]))


def grouped_dot(lhs, rhs, sizes):
    """``jax.lax.ragged_dot(lhs, rhs, sizes)``; megablox's kernel instead in a TPU program where
    ``unsupported`` allows it."""
    if unsupported(lhs, rhs) is not None:
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    return policy.on_tpu(functools.partial(policy.replicated, gmm), jax.lax.ragged_dot, lhs, rhs, sizes)
