"""A decode step's projections, x (M, K) @ w (K, N) for a few rows M, as an XLA FFI custom call
(cpu/matvec.cc) on two threads.

Why native code: a decode step reads every weight once per token, so its dots are bound by memory
bandwidth, and XLA:CPU runs each on one thread. The C++ kernel splits the columns of weights of at
least 256K floats with a helper thread that spins between calls (XLA's pool threads sleep, and
waking one cost more than it saved; docs/performance.md has the figures).

Float32 only; each output is summed in a fixed order, about 1e-7 from XLA's dot. Differentiable:
the backward pass is XLA's (dx = dy w^T, dw = x^T dy). The ``linear`` op (linear.py) runs it for at
most MAX_ROWS rows on the CPU.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.nn.kernels import calibrate, native

TARGET = "jaxgpt_matvec"
# Up to this many rows (a decode step's batch) it runs: past them XLA's GEMM does more work per weight
# read (docs/performance.md).
MAX_ROWS = 4


available = native.kernels("matvec.cc", {TARGET: "JaxgptMatvec"}, "decode steps run XLA's dots")

# The calibration's model: 24 one-row matvecs over 56 MB of weights (more than a CPU's caches, as a
# decode step streams a model's), alternately (384, 1536) and (1536, 384), each followed by a tanh.
CALIBRATION_SHAPES = ((384, 1536), (1536, 384)) * 12
# The kernel runs where it takes at most 90% of XLA's time: its helper thread spins between calls, a
# cost the chain does not see (docs/performance.md).
MARGIN = 0.9


def _measure() -> dict:
    """Seconds, best of five, of the calibration chain with the kernel and with XLA's dot (calibrate.py)."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for s in CALIBRATION_SHAPES]
    x = jnp.asarray(rng.standard_normal((1, CALIBRATION_SHAPES[0][0]), np.float32))

    def best(use_kernel: bool) -> float:
        @jax.jit
        def chain(x, ws):
            for w in ws:
                x = jnp.tanh(_matvec(x, w) if use_kernel else x @ w)
            return x

        return calibrate.best_seconds(chain, x, ws, calls=10)

    kernel, xla = best(True), best(False)
    return dict(wins=kernel < MARGIN * xla, kernel_s=kernel, xla_s=xla)


@functools.cache
def wins() -> bool:
    """Whether the kernel beats XLA's dot on this machine (measured once, cached on disk: calibrate.py)."""
    return available() and calibrate.decide("matvec", (native.CPU / "matvec.cc", Path(__file__)), _measure)


def applies(x, w) -> bool:
    """Whether ``matvec`` runs x (M, K) @ w (K, N): float32, M <= MAX_ROWS, the kernel built here and
    faster than XLA's dot on this machine (``wins``)."""
    return (x.ndim == 2 and w.ndim == 2 and x.shape[0] <= MAX_ROWS and x.dtype == jnp.float32
            and w.dtype == jnp.float32 and available() and wins())


def matvec(x, w):
    """x (M, K) @ w (K, N) -> (M, N) float32, on two threads. Differentiable."""
    if not available():
        raise RuntimeError("the CPU matvec kernel is unavailable here (see the warning above)")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matvec takes float32 x (M, K) and w (K, N); got {x.dtype} {tuple(x.shape)} and "
                         f"{w.dtype} {tuple(w.shape)}")
    return _matvec(x, w)


@jax.custom_vjp
def _matvec(x, w):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))(x, w)


def _fwd(x, w):
    return _matvec(x, w), (x, w)


def _bwd(res, dy):
    x, w = res
    return dy @ w.T, x.T @ dy  # (M, K), (K, N)


_matvec.defvjp(_fwd, _bwd)

__all__ = ["MAX_ROWS", "applies", "available", "matvec", "wins"]
