"""The execution policy: an Execution's 'auto' values resolved for the platform a program targets.

Two choices shape the traced program itself, so they cannot wait for the lowering
(``jax.lax.platform_dependent`` would trace the whole layer stack once per platform): the layer
loop's unroll (``scan_unroll='auto'``) and the float32 matmul precision (``matmul_precision='auto'``).
They follow ``target(execution)``: ``Execution.platform`` where set (an AOT lowering for another
platform names it: ``Execution(platform='tpu')``), else the platform of the default devices, the
ones ``jax.jit`` compiles for. Kernel choices inside the program stay per lowering platform
(``jaxgpt.nn.kernels.policy``).
"""
from __future__ import annotations

import jax

from jaxgpt.config.execution import MATMUL_PRECISIONS, Execution

__all__ = ["matmul_precision", "scan_unroll", "target"]


def target(execution: Execution | None = None) -> str:
    """The platform ('cpu', 'cuda', 'rocm' or 'tpu') whose choices ``execution`` gets."""
    if execution is not None and execution.platform is not None:
        return execution.platform
    backend = jax.default_backend()  # the default devices' platform: where jax.jit compiles a program
    if backend != "gpu":
        return backend
    return "rocm" if "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower() else "cuda"


def scan_unroll(execution: Execution, n_layer: int) -> int:
    """Layers per iteration of the scanned layer loop. 'auto': every layer in one iteration on the
    CPU and GPUs, where the rolled loop's per-layer weight slices and stacked activations slow the
    train step (docs/performance.md has the figure); rolled on TPUs (not measured) and with ``remat``,
    whose memory saving the rolled loop keeps (unrolled, XLA's schedule gave it back)."""
    if execution.scan_unroll != "auto":
        return execution.scan_unroll
    return n_layer if target(execution) in ("cpu", "cuda", "rocm") and execution.remat == "none" else 1


def matmul_precision(setting: str, dtype, platform: str | None = None) -> str | None:
    """The jax precision name matmuls computing in ``dtype`` run at on ``platform`` (None: ``target()``),
    or None for the platform's default (or whatever JAX-wide precision the user set). 'auto': full
    float32 for float32 compute off the CPU (the CPU computes them so already)."""
    if setting not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision={setting!r} is not one of {MATMUL_PRECISIONS}")
    if setting == "auto":
        platform = target() if platform is None else platform
        return "highest" if str(jax.numpy.dtype(dtype)) == "float32" and platform != "cpu" else None
    return None if setting == "default" else setting
