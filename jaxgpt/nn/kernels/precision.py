"""``Execution.matmul_precision``: the precision of float32 matmuls, decided once per model call.

Why: on NVIDIA GPUs (Ampere and later) XLA runs a float32 matmul at JAX's default precision in
TF32 (10-bit mantissa inputs), where torch keeps float32 matmuls in full float32 unless TF32 is
turned on. A float32 jaxgpt model then disagrees with torch by ~5e-4 on a GPU and agrees to 1e-7
on the CPU. The policy 'auto' gives float32 compute full-precision matmuls on every backend (the
CPU computes them so already: nothing changes there) and leaves half-precision compute at the
backend's default. 'default' opts in to TF32 (faster float32 training, ~1e-3 relative error).

    'auto'     float32 compute: 'highest' off the CPU; bfloat16/float16 compute: the backend default
    'default'  the backend default (TF32 for float32 on NVIDIA GPUs; bf16 passes on TPUs)
    'high'     jax.lax.Precision.HIGH (bf16_3x on TPUs; TF32 on GPUs)
    'highest'  full float32

Each module holding an Execution (the models, Block) decides for its call (``scope``), for the
platform the Execution targets (``jaxgpt.nn.kernels.exec_policy``); components without one (Attention, MLP,
SwiGLU, MoE) keep the decision of the module around them, and decide by their own
``matmul_precision`` and ``dtype`` only when used alone. A JAX-wide setting
(``jax.default_matmul_precision``, JAX_DEFAULT_MATMUL_PRECISION) is left alone wherever the policy
says 'default' or 'auto' resolves to the backend default.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax

from jaxgpt.nn.kernels import exec_policy

_DECIDED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxgpt_matmul_precision", default=False)


def resolve(setting: str, dtype, platform: str | None = None) -> str | None:
    """The jax precision name a model computing in ``dtype`` runs its matmuls at on ``platform``
    (None: the default devices'), or None: the platform's default (``exec_policy.matmul_precision``)."""
    return exec_policy.matmul_precision(setting, dtype, platform)


@contextlib.contextmanager
def scope(setting: str, dtype, *, defer: bool = False, platform: str | None = None):
    """Run the enclosed tracing at ``resolve(setting, dtype)``. ``defer``: unless an enclosing
    jaxgpt module already decided (a component inside a model keeps its model config's setting)."""
    if defer and _DECIDED.get():
        yield
        return
    name = resolve(setting, dtype, platform)
    token = _DECIDED.set(True)
    try:
        with jax.default_matmul_precision(name) if name is not None else contextlib.nullcontext():
            yield
    finally:
        _DECIDED.reset(token)


def current():
    """The precision in force while tracing (for custom VJPs, whose backward pass is traced after
    the module call has returned: they pass it to their dots explicitly)."""
    return jax.config.jax_default_matmul_precision


def _stack_config(module):
    """The ModelConfig (or the module itself) whose dtype decides: an encoder-decoder's decoder (its
    logits), a BERT classifier's encoder."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return module
    return getattr(cfg, "decoder", None) or getattr(cfg, "encoder", None) or cfg


def module_scope(method):
    """Decorate a module method (an ``nn.compact`` ``__call__``) so it runs under ``scope``: the
    setting is the module's Execution's ``matmul_precision`` for its platform (without one: deferred
    to the enclosing module, else ``self.matmul_precision``, 'auto' if absent), the dtype its
    ModelConfig's ``dtype`` (or ``self.dtype``)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        src, ex = _stack_config(self), getattr(self, "execution", None)
        setting = getattr(self, "matmul_precision", "auto") if ex is None else ex.matmul_precision
        with scope(setting, getattr(src, "dtype", "float32"), defer=ex is None,
                   platform=None if ex is None else exec_policy.target(ex)):
            return method(self, *args, **kwargs)
    return call


def float32_full(kernel):
    """Decorate a public attention kernel ``kernel(q, k, v, ...)``: called alone, float32 queries get
    full-precision matmuls off the CPU ('auto'); called inside a model, the model's setting holds.
    (On a GPU, a direct float32 ``scaled_dot_product_attention`` call ran TF32: 1.3e-3 from torch.)"""
    @functools.wraps(kernel)
    def call(q, *args, **kwargs):
        with scope("auto", q.dtype, defer=True):
            return kernel(q, *args, **kwargs)
    return call
