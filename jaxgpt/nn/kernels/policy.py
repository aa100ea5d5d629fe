"""Which kernel a program runs, decided per the platform it is lowered for, not the machine tracing it.

The C++ kernels (norm, GELU, causal and cached attention, matvec, paged attention, the panel head)
exist for the CPU only. A call that picks one ('auto', where the kernel is built here and takes the
call) is staged as ``jax.lax.platform_dependent(cpu=kernel, default=portable)``: a program lowered
for the CPU gets the kernel, one lowered for 'cuda', 'rocm' or 'tpu' (from this host, or traced on
it and run elsewhere) gets the pure-JAX path with the same numbers. With one lowering platform the
choice is made while lowering, so the CPU program holds the kernel alone (no conditional).

Kernels for other platforms are staged the same way (``by_platform``): the Pallas paged-attention
kernel in CUDA programs (paged_dispatch.py), ragged_dot MoE experts in CUDA and TPU ones (nn/moe.py).
The Pallas TPU kernels go the other way (``on_tpu``): ``platform_dependent(tpu=kernel,
default=portable)``, so only a program lowered for a TPU holds them (tpu_flash.py, tpu_paged.py:
attention; tpu_gmm.py: MoE's grouped matmul). Under a mesh they run inside a shard_map
(``pallas_mesh``, ``replicated``): XLA cannot partition a Pallas call.

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
from jax.sharding import PartitionSpec as P

__all__ = ["by_platform", "cpu_kernel", "on_cpu", "on_cuda", "on_tpu", "pallas_mesh", "replicated", "require_cpu",
           "require_platforms"]


def by_platform(*args, default: Callable, **kernels: Callable):
    """``kernels[p](*args)`` in a program lowered for platform p ('cpu', 'cuda', 'rocm', 'tpu'),
    ``default(*args)`` on the others (all traced here; the lowering keeps one)."""
    return jax.lax.platform_dependent(*args, default=_fresh(default), **{p: _fresh(f) for p, f in kernels.items()})


def _fresh(f: Callable) -> Callable:
    """A new closure over f: platform_dependent caches branches by function, and each call is traced anew."""
    return lambda *a: f(*a)


def on_cpu(kernel: Callable, portable: Callable, *args):
    """``kernel(*args)`` in a program lowered for the CPU, ``portable(*args)`` on every other platform."""
    return by_platform(*args, cpu=kernel, default=portable)


def on_cuda(kernel: Callable, portable: Callable, *args):
    """``kernel(*args)`` (cuDNN) in a program lowered for CUDA, ``portable(*args)`` elsewhere. Staged
    only where cuDNN can be traced (a GPU host): JAX cannot build a cuDNN call without it."""
    return by_platform(*args, cuda=kernel, default=portable)


def on_tpu(kernel: Callable, portable: Callable, *args):
    """``kernel(*args)`` (a Pallas TPU kernel) in a program lowered for a TPU, ``portable(*args)``
    elsewhere. Both are traced on any host; a CPU runs the kernel only in TPU interpret mode."""
    return by_platform(*args, tpu=kernel, default=portable)


def pallas_mesh():
    """-> (mesh, axes): the ambient (abstract) mesh a Pallas call must be shard_mapped over, and its
    axes not yet manual (all of them: Mosaic refuses even a size-1 axis left to XLA), where one of
    them is > 1; None where none is (no mesh, or inside a shard_map over every axis > 1, as the
    data-parallel step is). Lowering a Pallas call under a mesh without a shard_map fails ("Mosaic
    kernels cannot be automatically partitioned"). A mesh with manual and free axes > 1 both is
    refused (ValueError); the kernels' rules ask ``pallas_unsupported`` first."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    manual = set(getattr(mesh, "manual_axes", ()))
    big = [a for a, n in mesh.shape.items() if n > 1]
    free = tuple(a for a in big if a not in manual)
    if free and manual & set(big):
        raise ValueError(f"a Pallas TPU kernel under a mesh partly inside a shard_map (manual {sorted(manual)}, "
                         f"free {list(free)}) is not supported")
    return (mesh, tuple(a for a in mesh.axis_names if a not in manual)) if free else None


def replicated(kernel: Callable, *args):
    """``kernel(*args)``, a Pallas call, under the ambient mesh (pallas_mesh): in a shard_map whose
    every device computes the whole call on gathered operands (what XLA does with an operation it
    cannot split, made explicit); directly where there is no mesh."""
    found = pallas_mesh()
    if found is None:
        return kernel(*args)
    mesh, free = found
    return jax.shard_map(kernel, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), axis_names=set(free),
                         check_vma=False)(*args)


def pallas_unsupported() -> str | None:
    """Why the ambient mesh rules out a Pallas kernel (a mesh partly manual), or None."""
    try:
        pallas_mesh()
    except ValueError as e:
        return str(e)
    return None


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
