"""norm_impl='ffi': LayerNorm and RMSNorm for the CPU as two XLA FFI custom calls
(cpu/layer_norm.cc), forward and backward, under a ``jax.custom_vjp``.

Why native code: XLA:CPU hands a norm's reductions to YNNPACK fusions, which take only
materialised operands, so a differentiated norm wrote its scale and 1/std broadcast to full
(..., D) tensors besides the centred and the normalised input, a visible share of a 6 x 384, B 64,
T 256 train step on each device (docs/performance.md). The kernel reads each row once into
cache. Residuals are x and the per-row mean and 1/std. Float32 only; forward and gradients agree
with torch's to about 1e-6 (tested at 1e-5: parity_tests/test_norm_gelu_ffi.py).

Under a mesh, each call runs on its device's rows: ``custom_partitioning`` splits the leading axes
as x is split and replicates the last; the scale and bias gradients, summed over a device's rows,
are then summed over the devices that split the rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpt.nn.kernels import native

FWD, BWD = "jaxgpt_norm_fwd", "jaxgpt_norm_bwd"


available = native.kernels("layer_norm.cc", {FWD: "JaxgptNormFwd", BWD: "JaxgptNormBwd"},
                           "norm_impl='auto' runs the XLA norms")


def _fwd_call(x, w, b, eps, center):
    rows = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    call = jax.ffi.ffi_call(FWD, (jax.ShapeDtypeStruct(x.shape, x.dtype), rows, rows))
    return call(x, w, b, eps=np.float32(eps), center=center)


def _bwd_call(x, w, mean, rstd, dy, center):
    vec = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    return jax.ffi.ffi_call(BWD, (jax.ShapeDtypeStruct(x.shape, x.dtype), vec, vec))(x, w, mean, rstd, dy,
                                                                                    center=center)


def _shardings(mesh, arg_shapes):
    """(x's sharding with its last axis replicated, replicated, the per-row stats' sharding, the mesh
    axes the rows are split over), from x's sharding over its leading (row) axes."""
    spec = tuple(getattr(arg_shapes[0].sharding, "spec", ()) or ())
    rows = (spec + (None,) * (len(arg_shapes[0].shape) - len(spec)))[:-1]
    axes = tuple(a for s in rows if s is not None for a in ([s] if isinstance(s, str) else s))
    return NamedSharding(mesh, P(*rows, None)), NamedSharding(mesh, P()), NamedSharding(mesh, P(*rows)), axes


_rank_letters = "abcdefgh"


def _fwd_rule(rank: int) -> str:
    lead = " ".join(_rank_letters[:rank - 1])
    return f"{lead} z, z, z -> {lead} z, {lead}, {lead}"


def _bwd_rule(rank: int) -> str:
    lead = " ".join(_rank_letters[:rank - 1])
    return f"{lead} z, z, {lead}, {lead}, {lead} z -> {lead} z, z, z"


def _fwd_infer(eps, center, mesh, arg_shapes, result_shape):
    x_sh, _, row_sh, _ = _shardings(mesh, arg_shapes)
    return x_sh, row_sh, row_sh


def _fwd_partition(eps, center, mesh, arg_shapes, result_shape):
    x_sh, rep, row_sh, _ = _shardings(mesh, arg_shapes)
    return mesh, lambda x, w, b: _fwd_call(x, w, b, eps, center), (x_sh, row_sh, row_sh), (x_sh, rep, rep)


def _bwd_infer(center, mesh, arg_shapes, result_shape):
    x_sh, rep, _, _ = _shardings(mesh, arg_shapes)
    return x_sh, rep, rep


def _bwd_partition(center, mesh, arg_shapes, result_shape):
    x_sh, rep, row_sh, axes = _shardings(mesh, arg_shapes)

    def run(x, w, mean, rstd, dy):
        dx, dw, db = _bwd_call(x, w, mean, rstd, dy, center)
        if axes:  # each device summed its own rows
            dw, db = jax.lax.psum((dw, db), axes)
        return dx, dw, db

    return mesh, run, (x_sh, rep, rep), (x_sh, rep, row_sh, row_sh, x_sh)


@functools.cache
def _ops(rank: int):
    fwd = custom_partitioning(_fwd_call, static_argnums=(3, 4))
    fwd.def_partition(infer_sharding_from_operands=_fwd_infer, partition=_fwd_partition,
                      sharding_rule=_fwd_rule(rank))
    bwd = custom_partitioning(_bwd_call, static_argnums=(5,))
    bwd.def_partition(infer_sharding_from_operands=_bwd_infer, partition=_bwd_partition,
                      sharding_rule=_bwd_rule(rank))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, w, b, eps, center):
    return _ops(x.ndim)[0](x, w, b, eps, center)[0]


def _norm_fwd(x, w, b, eps, center):
    y, mean, rstd = _ops(x.ndim)[0](x, w, b, eps, center)
    return y, (x, w, mean, rstd)


def _norm_bwd(eps, center, res, dy):
    x, w, mean, rstd = res
    return _ops(x.ndim)[1](x, w, mean, rstd, dy, center)


_norm.defvjp(_norm_fwd, _norm_bwd)


def unsupported(x) -> str | None:
    """Why the kernel cannot normalise x (None: it can)."""
    if x.dtype != jnp.float32:
        return f"it computes in float32 (got {x.dtype})"
    if x.ndim < 2 or x.ndim > len(_rank_letters):
        return f"it takes x of rank 2 to {len(_rank_letters)} (got {x.ndim})"
    if not available():
        return f"the kernel is unavailable on this {jax.default_backend()} backend"
    return None


def _check():
    if not available():
        raise RuntimeError("the CPU norm kernel is unavailable here (see the warning above)")


def layer_norm(x, scale, bias=None, *, eps: float):
    """LayerNorm of x (..., D) float32 over its last axis: (x - mean) / sqrt(var + eps) * scale + bias."""
    _check()
    return _norm(x, scale, jnp.zeros_like(scale) if bias is None else bias, float(eps), True)


def rms_norm(x, scale, *, eps: float):
    """RMSNorm of x (..., D) float32 over its last axis: x / sqrt(mean(x^2) + eps) * scale."""
    _check()
    return _norm(x, scale, jnp.zeros_like(scale), float(eps), False)


__all__ = ["available", "layer_norm", "rms_norm", "unsupported"]
