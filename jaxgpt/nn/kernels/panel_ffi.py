"""The serving engine's vocabulary projection on the CPU: x (M, d) @ w (d, V) + b with w packed once
into 64-column panels (``pack``), and each row's argmax in the same pass, as an XLA FFI custom call
(cpu/panel_matmul.cc).

Why native code: a decode step projects its 1-32 rows onto the whole vocabulary, and XLA:CPU's GEMM
reads a row-major (d, V) weight slowly at those row counts; packed, a register tile streams one
contiguous panel, and the argmax is taken as the logits leave the registers (docs/serving.md has the
figures). Inference only (no gradient); float32; each output is summed over d in order, about 1e-6 from XLA's dot. Whether it
runs is measured on each machine (``wins``, calibrate.py): the engine's head_kernel='auto'.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.nn.kernels import calibrate, native

TARGET = "jaxgpt_panel_matmul"
PANEL = 64  # columns a panel (cpu/panel_matmul.cc kPanel)
# The calibration's shape, a small LLaMA's head, and row counts: a decode step's few rows and a full batch.
CALIBRATION_SHAPE, CALIBRATION_ROWS = (256, 32000), (4, 32)
# The kernel runs where it takes at most this fraction of XLA's time at every calibration row count.
MARGIN = 0.9

available = native.kernels("panel_matmul.cc", {TARGET: "JaxgptPanelMatmul"}, "the engine's head runs XLA's dot")


def pack(w):
    """w (K, N) -> its panels (ceil(N / 64), K, 64) float32, zero-padded past N: done once, where the
    weights are loaded (a copy the size of w)."""
    k, n = w.shape
    p = -(-n // PANEL)
    w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, p * PANEL - n)))
    return w.reshape(k, p, PANEL).transpose(1, 0, 2)  # (P, K, 64)


def panel_matmul(x, panels, n: int, bias=None, valid: int | None = None):
    """x (M, K) float32 @ the w (K, n) that ``pack`` gave ``panels``, + bias (n,) ->
    (logits (M, n) float32 with the columns from ``valid`` on at float32's minimum, as
    decoder.mask_padded_vocab sets them; each row's argmax (M,) int32, the first maximum, the first
    NaN if any: ``argmax``'s)."""
    if not available():
        raise RuntimeError("the CPU panel-matmul kernel is unavailable here (see the warning above)")
    if (x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], PANEL) or -(-n // PANEL) != panels.shape[0]
            or x.dtype != jnp.float32 or panels.dtype != jnp.float32):
        raise ValueError(f"panel_matmul takes float32 x (M, K) and panels (ceil(n / {PANEL}), K, {PANEL}) for n={n}; "
                         f"got {x.dtype} {tuple(x.shape)} and {panels.dtype} {tuple(panels.shape)}")
    valid = n if valid is None else valid
    if not 0 < valid <= n:
        raise ValueError(f"valid={valid} must be in (0, n={n}]")
    width = panels.shape[0] * PANEL
    b = jnp.zeros((width,), jnp.float32) if bias is None else jnp.pad(jnp.asarray(bias, jnp.float32), (0, width - n))
    out = (jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return jax.ffi.ffi_call(TARGET, out)(x, panels, b, valid=np.int64(valid))


def argmax(logits):
    """jnp.argmax over the last axis (the first maximum; the first NaN if any), as the kernel picks it,
    written as two plain reductions, max then min: XLA:CPU runs argmax's (value, index) reduce
    unvectorised (docs/serving.md). The engine's argmax (inference/sampling.py)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)  # a NaN max equals nothing; argmax returns the first NaN
    return jnp.min(jnp.where(hit, iota, logits.shape[-1]), axis=-1)


def _measure() -> dict:
    """Seconds, best of five, of a 4-deep chain of head projections with their argmax, packed and with
    XLA's dot plus the engine's argmax, at each calibration row count (calibrate.py): the kernel wins
    if it is faster at all of them by MARGIN."""
    rng = np.random.default_rng(0)
    k, n = CALIBRATION_SHAPE
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05)
    panels = pack(w)
    out = {}
    for m in CALIBRATION_ROWS:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        # each a step's head: logits and their argmax
        kernel = jax.jit(lambda x, p: sum(panel_matmul(x + i, p, n)[1].sum() for i in range(4)))
        xla = jax.jit(lambda x, w: sum(argmax((x + i) @ w).sum() for i in range(4)))
        out[f"kernel_s_rows{m}"] = calibrate.best_seconds(kernel, x, panels) / 4
        out[f"xla_s_rows{m}"] = calibrate.best_seconds(xla, x, w) / 4
    out["wins"] = all(out[f"kernel_s_rows{m}"] < MARGIN * out[f"xla_s_rows{m}"] for m in CALIBRATION_ROWS)
    return out


@functools.cache
def wins() -> bool:
    """Whether the kernel beats XLA's dot on this machine (measured once, cached on disk: calibrate.py)."""
    return available() and calibrate.decide("panel_matmul", (native.CPU / "panel_matmul.cc", Path(__file__)), _measure)


__all__ = ["PANEL", "argmax", "available", "pack", "panel_matmul", "wins"]
