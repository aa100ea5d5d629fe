"""act_impl='ffi': the exact GELU for the CPU as two XLA FFI custom calls (cpu/gelu.cc), forward and
backward, under a ``jax.custom_vjp``.

Why native code: XLA:CPU ran the differentiated GELU of a 6 x 384, B 64, T 256 train step as three
passes over the (N, 4 d) hidden activations (erf into a saved Phi(x), x Phi(x), the backward's),
nearly a tenth of the step on each device (docs/performance.md). The kernel's forward
reads x once and writes y; its backward reads x and dy once. The residual is x alone. Float32 only;
it agrees with torch's GELU to about 2e-7 (tested at 1e-5: parity_tests/test_norm_gelu_ffi.py).

Elementwise, so under a mesh each device runs the kernel on its own block: ``custom_partitioning``
keeps whatever sharding x has.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.nn.kernels import native

FWD, BWD = "jaxgpt_gelu_fwd", "jaxgpt_gelu_bwd"
_LETTERS = "abcdefgh"


available = native.kernels("gelu.cc", {FWD: "JaxgptGeluFwd", BWD: "JaxgptGeluBwd"}, "act_impl='auto' runs XLA's GELU")


def _fwd_call(x):
    return jax.ffi.ffi_call(FWD, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _bwd_call(x, dy):
    return jax.ffi.ffi_call(BWD, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, dy)


def _like_x(mesh, arg_shapes) -> NamedSharding:
    spec = getattr(arg_shapes[0].sharding, "spec", None)
    return NamedSharding(mesh, spec if spec is not None else P())


def _elementwise(fn, n_args: int, rank: int):
    """``fn`` as a custom_partitioning op that runs on each device's block of x (every operand and
    the result sharded as x is)."""
    op = custom_partitioning(fn)
    dims = " ".join(_LETTERS[:rank])

    def infer(mesh, arg_shapes, result_shape):
        return _like_x(mesh, arg_shapes)

    def partition(mesh, arg_shapes, result_shape):
        sh = _like_x(mesh, arg_shapes)
        return mesh, fn, sh, (sh,) * n_args

    op.def_partition(infer_sharding_from_operands=infer, partition=partition,
                     sharding_rule=", ".join([dims] * n_args) + f" -> {dims}")
    return op


@functools.cache
def _ops(rank: int):
    return _elementwise(_fwd_call, 1, rank), _elementwise(_bwd_call, 2, rank)


@jax.custom_vjp
def _gelu(x):
    return _ops(x.ndim)[0](x)


def _gelu_fwd(x):
    return _ops(x.ndim)[0](x), x


def _gelu_bwd(x, dy):
    return (_ops(x.ndim)[1](x, dy),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def unsupported(x) -> str | None:
    """Why the kernel cannot take x (None: it can)."""
    if x.dtype != jnp.float32:
        return f"it computes in float32 (got {x.dtype})"
    if not 1 <= x.ndim <= len(_LETTERS):
        return f"it takes x of rank 1 to {len(_LETTERS)} (got {x.ndim})"
    if not available():
        return f"the kernel is unavailable on this {jax.default_backend()} backend"
    return None


def gelu(x):
    """Exact GELU x Phi(x) of a float32 array, differentiable."""
    if not available():
        raise RuntimeError("the CPU GELU kernel is unavailable here (see the warning above)")
    return _gelu(x)


__all__ = ["available", "gelu", "unsupported"]
