"""Position-wise feed-forward networks: two-matrix MLP (relu / gelu / gelu_tanh) and SwiGLU, and the
Linear layer every model projects with."""
from __future__ import annotations

from typing import Callable, ClassVar

import flax.linen as nn
import jax

from jaxgpt.config import Execution
from jaxgpt.config.execution import DEFAULT_EXECUTION
from jaxgpt.nn.kernels.activation import ACTIVATIONS, activation, gelu  # noqa: F401  (public names)
from jaxgpt.nn.kernels.linear import linear
from jaxgpt.nn.kernels.precision import module_scope


class Dense(nn.Module):
    """y = x @ kernel + bias over the last axis: nn.Dense's parameters, computed by kernels.linear.

    Weights are stored in ``param_dtype`` and cast to ``dtype`` for the matmul (mixed precision).
    ``f32_out``: accumulate and return float32 whatever ``dtype`` is (logits heads: a bfloat16
    output would round the logits to 3 significant digits before the loss)."""

    features: int
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    dtype: str = "float32"
    param_dtype: str = "float32"
    f32_out: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)  # (in, out)
        b = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        return linear(x, w, b, dtype=self.dtype, f32_out=self.f32_out)


def dense(features: int, use_bias: bool, std: float, name: str, dtype: str = "float32",
          param_dtype: str = "float32", f32_out: bool = False) -> Dense:
    """A Linear layer with N(0, std) kernel and zero bias (the GPT-2 / seed initialisation)."""
    return Dense(features, use_bias=use_bias, kernel_init=nn.initializers.normal(std), dtype=dtype,
                 param_dtype=param_dtype, f32_out=f32_out, name=name)


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
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)

    @nn.compact
    @module_scope
    def __call__(self, x):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {sorted(ACTIVATIONS)}")
        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.d_ff, self.use_bias, self.init_std, "fc_in", **dt)(x)  # (..., d_ff)
        h = activation(self.activation, h, self.act_impl)
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
    matmul_precision: str = "auto"  # config.MATMUL_PRECISIONS (used alone; inside a model, the model's)
    gate_act: ClassVar[Callable] = staticmethod(jax.nn.silu)  # the gate's activation (GeGLU: tanh-GELU)

    @nn.compact
    @module_scope
    def __call__(self, x):
        dt = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        gate = dense(self.d_ff, self.use_bias, self.init_std, "gate_proj", **dt)(x)  # (..., d_ff)
        up = dense(self.d_ff, self.use_bias, self.init_std, "up_proj", **dt)(x)
        return dense(self.d_model, self.use_bias, self.out_init_std, "down_proj", **dt)(self.gate_act(gate) * up)


def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): torch's gelu(approximate='tanh'), HF's gelu_pytorch_tanh."""
    return jax.nn.gelu(x, approximate=True)


class GeGLU(SwiGLU):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) (``mlp='geglu_tanh'``, Gemma's MLP): SwiGLU's
    parameters with another gate activation. x: (..., d_model) -> (..., d_model)."""

    gate_act: ClassVar[Callable] = staticmethod(gelu_tanh)


def make_mlp(config, name: str = "mlp", execution: Execution = DEFAULT_EXECUTION) -> nn.Module:
    """The feed-forward network a ModelConfig names, run with ``execution``'s kernels."""
    common = dict(d_model=config.d_model, d_ff=config.ffn_dim, use_bias=config.mlp_bias,
                  init_std=config.init_std, out_init_std=config.out_init_std, dtype=config.dtype,
                  param_dtype=config.param_dtype, matmul_precision=execution.matmul_precision, name=name)
    if config.mlp in ("swiglu", "geglu_tanh"):
        return (GeGLU if config.mlp == "geglu_tanh" else SwiGLU)(**common)
    return MLP(activation=config.mlp, act_impl=execution.act_impl, **common)
