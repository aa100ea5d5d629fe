"""Which kernel a program runs, decided per the platform it is lowered for, not the machine tracing it.

The C++ kernels (norm, GELU, causal and cached attention, matvec, paged attention, the panel head)
exist for the CPU only. A call that picks one ('auto', where the kernel is built here and takes the
call) is staged as ``jax.lax.platform_dependent(cpu=kernel, default=portable)``: a program lowered
for the CPU gets the kernel, one lowered for 'cuda', 'rocm' or 'tpu' (from this host, or traced on
it and run elsewhere) gets the pure-JAX path with the same numbers. With one lowering platform the
choice is made while lowering, so the CPU program holds the kernel alone (no conditional).

Kernels for other platforms are staged the same way (``by_platform``): the Pallas paged-attention
kernel in CUDA programs (paged_dispatch.py), ragged_dot MoE experts in CUDA and TPU ones (nn/moe.py).

An explicit choice of a CPU kernel (``norm_impl='ffi'``, ``act_impl='ffi'``, ``attention_impl='ffi'``)
is honoured on the CPU and refused, with a message naming the knob, when the program is lowered for
another platform (``require_cpu``): a user who asked for the kernel gets it or an error, never a
silent switch.

``jax.default_backend()`` is still asked where it is about this machine, not the target: whether the
kernels are built here at all (kernels/native.py, CPU hosts only) and the per-machine calibrations
(calibrate.py). A program lowered for the CPU from a GPU or TPU host takes the portable paths.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["by_platform", "cpu_kernel", "on_cpu", "on_cuda", "require_cpu", "require_platforms"]


def on_cpu(kernel: Callable, portable: Callable, *args):
    """``kernel(*args)`` in a program lowered for the CPU, ``portable(*args)`` on every other
    platform (both traced here; the lowering keeps one)."""
    # fresh closures: each call traced anew, as a direct call is (platform_dependent caches branches by function)
    return jax.lax.platform_dependent(*args, cpu=lambda *a: kernel(*a), default=lambda *a: portable(*a))


def on_cuda(kernel: Callable, portable: Callable, *args):
    """``kernel(*args)`` (cuDNN) in a program lowered for CUDA, ``portable(*args)`` elsewhere. Staged
    only where cuDNN can be traced (a GPU host): JAX cannot build a cuDNN call without it."""
    return jax.lax.platform_dependent(*args, cuda=lambda *a: kernel(*a), default=lambda *a: portable(*a))


def by_platform(*args, default: Callable, **kernels: Callable):
    """``kernels[p](*args)`` in a program lowered for platform p ('cpu', 'cuda', 'rocm', 'tpu'),
    ``default(*args)`` on the others (all traced here; the lowering keeps one)."""
    return jax.lax.platform_dependent(*args, default=_fresh(default), **{p: _fresh(f) for p, f in kernels.items()})


def _fresh(f: Callable) -> Callable:
    """A new closure over f: platform_dependent caches branches by function, and each call is traced anew."""
    return lambda *a: f(*a)


_require_cpu_p = Primitive("jaxgpt_require_cpu")
_require_cpu_p.multiple_results = True
_require_cpu_p.def_impl(lambda *xs, what, platforms: xs)
_require_cpu_p.def_abstract_eval(lambda *avals, what, platforms: avals)


def _lower(ctx, *xs, what, platforms):
    lowered = tuple(ctx.module_context.platforms)
    if any(p not in platforms for p in lowered):
        if platforms == ("cpu",):
            raise ValueError(f"{what} runs a C++ CPU kernel, but this program is lowered for {', '.join(lowered)}; "
                             f"use 'auto' (the kernel on the CPU, the portable path elsewhere) or 'xla'")
        raise ValueError(f"{what} runs a kernel for {', '.join(platforms)} only, but this program is lowered for "
                         f"{', '.join(lowered)}; use 'auto' (each platform's kernel, the portable path elsewhere)")
    return xs


def _jvp(primals, tangents, **params):
    return _require_cpu_p.bind(*primals, **params), tangents


mlir.register_lowering(_require_cpu_p, _lower)
ad.primitive_jvps[_require_cpu_p] = _jvp
batching.primitive_batchers[_require_cpu_p] = lambda xs, dims, **params: (_require_cpu_p.bind(*xs, **params), dims)


def require_platforms(*xs, what: str, platforms: tuple[str, ...]):
    """xs (arrays, or pytrees of them) unchanged, in a program that fails to lower, with a message
    naming ``what`` (the knob the user set, e.g. "paged_kernel='pallas'"), for any platform not in
    ``platforms``. Emits nothing on those."""
    leaves, tree = jax.tree.flatten(xs)
    return jax.tree.unflatten(tree, _require_cpu_p.bind(*leaves, what=what, platforms=tuple(platforms))) if leaves else xs


def require_cpu(*xs, what: str):
    """``require_platforms`` for the CPU: xs unchanged, in a program that fails to lower off the CPU."""
    return require_platforms(*xs, what=what, platforms=("cpu",))


def cpu_kernel(use: bool, forced: bool, kernel: Callable, portable: Callable, *args, what: str = ""):
    """The one dispatch of a CPU kernel: ``portable(*args)`` where the kernel is not used (``use``
    False: not built here, or the call is not one it takes); ``kernel(*args)`` on the CPU and
    ``portable(*args)`` elsewhere for an 'auto' choice; ``kernel`` alone, refused off the CPU
    (``require_cpu``), where the user ``forced`` it (``what`` names the knob)."""
    if not use:
        return portable(*args)
    if forced:
        return kernel(*require_cpu(*args, what=what))
    return on_cpu(kernel, portable, *args)
