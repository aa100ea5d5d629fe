"""Position-wise feed-forward networks: two-matrix MLP (relu / gelu / gelu_tanh) and SwiGLU."""
from __future__ import annotations

import functools
from typing import Callable, ClassVar

import flax.linen as nn
import jax

from jaxgpt.config import ACT_IMPLS, Execution
from jaxgpt.config.execution import DEFAULT_EXECUTION
from jaxgpt.nn import head
from jaxgpt.nn.kernels import gelu_ffi, matvec_ffi, native, policy
from jaxgpt.nn.precision import current as precision_in_force, module_scope


def gelu(x):
    """Exact GELU, x * Phi(x), written as torch writes it: 0.5 x (1 + erf(x / sqrt 2)).

    Why not jax.nn.gelu(approximate=False): it uses erfc(-x / sqrt 2), whose XLA:CPU expansion
    evaluates two polynomial branches and a select; this form made the cpu-small train step 1.17x
    faster on one core (docs/performance.md). Same function: the two differ by float rounding."""
    return x * (0.5 + 0.5 * jax.lax.erf(x * (2 ** -0.5)))


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu,  # torch nn.GELU() default: exact erf
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's "gelu_new"
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _narrowing_matmul(x, w, prec):
    """x (N, in) @ w (in, out) for in > out, whose kernel gradient is computed as (out, in) and
    transposed. Why: Eigen's GEMM (the CPU train step's dots) writes a tall (in, out) = x^T dy at
    143 GFLOP/s and the wide (out, in) = dy^T x at 185 (one core, N 8192, 1536 -> 384); the
    barrier keeps XLA from folding the transpose back into the dot. A 6 x 384 train step: 1.02x.
    ``prec``: the matmul precision in force (the backward pass is traced after the module call)."""
    return x @ w


def _narrowing_fwd(x, w, prec):
    return x @ w, (x, w)


def _narrowing_bwd(prec, res, dy):
    x, w = res
    dx = jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())), precision=prec)  # (N, in)
    dw = jax.lax.optimization_barrier(jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ())), precision=prec))  # (out, in)
    return dx, dw.T


_narrowing_matmul.defvjp(_narrowing_fwd, _narrowing_bwd)


def _plain(lhs, rhs, dimension_numbers, precision, preferred_element_type) -> bool:
    """A plain (N, in) @ (in, out)."""
    return (lhs.ndim == 2 and rhs.ndim == 2 and dimension_numbers == (((1,), (0,)), ((), ()))
            and precision is None and preferred_element_type is None)


def _dot(lhs, rhs):
    return jax.lax.dot_general(lhs, rhs, (((1,), (0,)), ((), ())))


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """nn.Dense's dot_general: in a program lowered for the CPU, ``_narrowing_matmul`` for a plain
    (N, in) @ (in, out) with in > out (kernels/policy.py), ``lax.dot_general`` otherwise. The same
    products; only the summation order of the kernel gradient may differ (float rounding)."""
    if _plain(lhs, rhs, dimension_numbers, precision, preferred_element_type) and rhs.shape[0] > rhs.shape[1]:
        return policy.on_cpu(functools.partial(_narrowing_matmul, prec=precision_in_force()), _dot, lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)


def matvec_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``rows_dot_general``, but in a program lowered for the CPU a decode step's few rows (at most
    matvec_ffi.MAX_ROWS, float32) run the two-thread ``matvec_ffi.matvec``. For weights read where
    they lie (separate layers): a kernel weight sliced out of scanned layers would be copied for the
    custom call every step, where XLA's dot reads the slice in place (docs/performance.md has the
    measurement)."""
    plain = _plain(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    portable = functools.partial(rows_dot_general, dimension_numbers=dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type)
    return policy.cpu_kernel(plain and matvec_ffi.applies(lhs, rhs), False, matvec_ffi.matvec, portable, lhs, rhs)


class Dense(nn.Dense):
    """nn.Dense applied to the (N, in) matrix of rows, same params. Why: for a (B, T, in) input,
    XLA:CPU computes the kernel gradient through a strided transposed buffer; flattening made a
    SwiGLU forward + backward 8x faster and the seed MiniGPT train step 1.6x faster."""

    dot_general: object = rows_dot_general

    @nn.compact
    def __call__(self, x):
        y = super().__call__(x.reshape(-1, x.shape[-1]))  # (N, features)
        return y.reshape(*x.shape[:-1], self.features)


def dense(features: int, use_bias: bool, std: float, name: str, dtype: str = "float32",
          param_dtype: str = "float32", f32_out: bool = False, matvec: bool = False) -> Dense:
    """A Linear layer with N(0, std) kernel and zero bias (the GPT-2 / seed initialisation).

    Weights are stored in ``param_dtype`` and cast to ``dtype`` for the matmul (mixed precision).
    ``f32_out``: accumulate and return float32 whatever ``dtype`` is (logits heads: a bfloat16
    output would round the logits to 3 significant digits before the loss). ``matvec``: a few rows
    run the two-thread matvec kernel (``matvec_dot_general``; for layers that are not scanned)."""
    if f32_out:
        dot = head.head_dot_general
    else:
        dot = matvec_dot_general if matvec else rows_dot_general
    return Dense(features, use_bias=use_bias, kernel_init=nn.initializers.normal(std), dtype=dtype,
                 param_dtype=param_dtype, dot_general=dot, name=name)


def activate(name: str, h, impl: str = "auto"):
    """ACTIVATIONS[name](h); the exact GELU runs the C++ CPU kernel (kernels/gelu_ffi.py: 1.05x on a
    6 x 384 train step) where ``impl`` lets it (Execution.act_impl: 'ffi', or 'auto' on at least
    native.AUTO_MIN_SIZE floats) and it can (float32, the kernel built here), in programs lowered
    for the CPU (kernels/policy.py), and XLA's otherwise. 'ffi' where it cannot is an error."""
    use = native.use_kernel("act_impl", impl, ACT_IMPLS, h, gelu_ffi.unsupported, applies=name == "gelu")
    return policy.cpu_kernel(use, impl == "ffi", gelu_ffi.gelu, ACTIVATIONS[name], h, what="act_impl='ffi'")


class MLP(nn.Module):
    """fc_out(act(fc_in(x))). x: (..., d_model) -> (..., d_model)."""

    d_model: int
    d_ff: int
    activation: str = "gelu"
    use_bias: bool = True
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: str = "float32"  # compute dtype (activations, matmuls)
    param_dtype: str = "float32"
    act_impl: str = "auto"  # ACT_IMPLS
    matvec: bool = False  # dense(matvec=): decode-step rows on the matvec kernel
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)

    @nn.compact
    @module_scope
    def __call__(self, x):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {sorted(ACTIVATIONS)}")
        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype, matvec=self.matvec)
        h = dense(self.d_ff, self.use_bias, self.init_std, "fc_in", **dt)(x)  # (..., d_ff)
        h = activate(self.activation, h, self.act_impl)
        return dense(self.d_model, self.use_bias, self.out_init_std, "fc_out", **dt)(h)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)). x: (..., d_model) -> (..., d_model)."""

    d_model: int
    d_ff: int
    use_bias: bool = False
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: str = "float32"  # compute dtype (activations, matmuls)
    param_dtype: str = "float32"
    matvec: bool = False  # dense(matvec=): decode-step rows on the matvec kernel
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)
    gate_act: ClassVar[Callable] = staticmethod(jax.nn.silu)  # the gate's activation (geglu.GeGLU: tanh-GELU)

    @nn.compact
    @module_scope
    def __call__(self, x):
        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype, matvec=self.matvec)
        gate = dense(self.d_ff, self.use_bias, self.init_std, "gate_proj", **dt)(x)  # (..., d_ff)
        up = dense(self.d_ff, self.use_bias, self.init_std, "up_proj", **dt)(x)
        return dense(self.d_model, self.use_bias, self.out_init_std, "down_proj", **dt)(self.gate_act(gate) * up)


def make_mlp(config, name: str = "mlp", execution: Execution = DEFAULT_EXECUTION) -> nn.Module:
    """The feed-forward network a ModelConfig names, run with ``execution``'s kernels."""
    common = dict(d_model=config.d_model, d_ff=config.ffn_dim, use_bias=config.mlp_bias,
                  init_std=config.init_std, out_init_std=config.out_init_std, dtype=config.dtype,
                  param_dtype=config.param_dtype, matvec=not execution.scan_layers,
                  matmul_precision=execution.matmul_precision, name=name)
    if config.mlp in ("swiglu", "geglu_tanh"):
        from jaxgpt.nn.geglu import GeGLU  # SwiGLU's subclass: imported here, not at the top
        return (GeGLU if config.mlp == "geglu_tanh" else SwiGLU)(**common)
    return MLP(activation=config.mlp, act_impl=execution.act_impl, **common)
