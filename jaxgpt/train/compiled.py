"""How the train and eval steps are compiled and dispatched on each backend: the workarounds, apart
from the step's math (train/step.py). XLA compiler options per backend (``compiler_options``), a
jit that takes them only at the top level (``Jit``), a bound on in-flight multi-device CPU programs
(``Paced``), and compiling the first program on a thread while the state initialises
(``compile_ahead``). None of them changes a number.
"""
from __future__ import annotations

import collections
import functools
import threading

import jax
import jax.numpy as jnp


# XLA:CPU hands each dot to YNNPACK and each reduction too; Eigen's dots are faster for the train step, so the
# train and eval steps keep YNNPACK for the reductions only (docs/performance.md, "Eigen for the CPU steps' dots").
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
# XLA:GPU writes some GEMMs and their fused neighbours as Triton kernels; cuBLAS's GEMMs make the bf16 train
# step faster (results/engine/gpu.md; docs/performance.md).
GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


@functools.cache
def compiler_options() -> dict:
    """The train and eval steps' XLA options for this backend (``CPU_OPTIONS``, ``GPU_OPTIONS``) where this jaxlib
    takes them (they are experimental or internal: a jaxlib without them compiles the steps with its
    defaults), else {}: ``jax.jit``'s ``compiler_options``."""
    options = {"cpu": CPU_OPTIONS, "gpu": GPU_OPTIONS}.get(jax.default_backend())
    if not options:
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(jnp.float32(0)).compile()
    except Exception:  # noqa: BLE001 - an unknown option or value: XLA's defaults, which are correct too
        return {}
    return dict(options)


def traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


class Jit:
    """``jax.jit(fn, **kw)``, compiled with ``compiler_options()`` when called at the top level.
    Inside another jit (JAX takes compiler_options only at the top) it is the plain jit, compiled
    with the outer program's options. Other attributes (``lower``, ...) are the top-level jit's."""

    def __init__(self, fn, **kw):
        options = compiler_options()
        self._plain = jax.jit(fn, **kw)
        self._top = jax.jit(fn, compiler_options=options, **kw) if options else self._plain

    def __call__(self, *args):
        return (self._plain if traced(args) else self._top)(*args)

    def __getattr__(self, name):
        return getattr(self._top, name)


class Paced:
    """``fn`` with at most ``depth`` calls in flight: each call first waits for the outputs
    (``keep(out)``) of the call ``depth`` before it. Why: XLA:CPU launches a multi-device program's
    per-device parts as separate pool tasks and lets each device hold a bounded number of programs in
    flight, so a loop that dispatches many collective steps without reading a result could fill one
    device's slots with later steps while the other waits in an earlier step's all-reduce, and XLA's
    rendezvous aborts the process (docs/troubleshooting.md). Any attribute other than the call
    (``lower``, ...) is ``fn``'s."""

    def __init__(self, fn, keep=lambda out: out, depth: int = 4):
        self._fn, self._keep, self._depth, self._pending = fn, keep, depth, collections.deque()

    def __call__(self, *args):
        while len(self._pending) >= self._depth:
            jax.block_until_ready(self._pending.popleft())
        out = self._fn(*args)
        kept = self._keep(out)
        if not traced(kept):  # traced under an outer jit
            self._pending.append(kept)
        return out

    def __getattr__(self, name):
        return getattr(self._fn, name)


def paced(fn, mesh, keep=lambda out: out):
    """``Paced(fn)`` for a program over several CPU devices (which has collectives); else ``fn``."""
    if mesh is None or mesh.devices.size < 2 or mesh.devices.flat[0].platform != "cpu":
        return fn
    return Paced(fn, keep)


def compile_ahead(fn, *args) -> threading.Thread | None:
    """Compile jitted ``fn`` for ``args`` (abstract: ``jax.ShapeDtypeStruct`` with the shardings the
    real call will have) on a thread, into JAX's persistent compilation cache, while the caller goes
    on; join the thread before the first call, which then loads the program instead of compiling it.
    None (nothing started) when no persistent cache is on, since the program would be compiled twice.
    Why: ``fit`` initialises the state (compiling its init on one core) while the train program
    compiles on the other (docs/performance.md, "the train program compiles ahead")."""
    if not jax.config.jax_compilation_cache_dir:
        return None

    def run():
        try:
            fn.lower(*args).compile()
        except Exception:  # noqa: BLE001 - the real call compiles it again, and raises what is wrong
            pass

    thread = threading.Thread(target=run, name="jaxgpt-compile-ahead", daemon=True)
    thread.start()
    return thread


__all__ = ["CPU_OPTIONS", "GPU_OPTIONS", "Jit", "Paced", "compile_ahead", "compiler_options", "paced", "traced"]
