"""The ``activation`` op: the feed-forward activations, the exact GELU by XLA or the C++ CPU kernel.

``impl`` (the act_impl knob): the exact GELU runs the C++ CPU kernel (gelu_ffi.py) where ``impl``
lets it ('ffi', or 'auto' on at least native.AUTO_MIN_SIZE floats) and it can (float32, the kernel
built here), in programs lowered for the CPU (policy.py), and XLA's otherwise. 'ffi' where it
cannot is an error.
"""
from __future__ import annotations

import jax

from jaxgpt.config import ACT_IMPLS
from jaxgpt.nn.kernels import gelu_ffi, native, policy

__all__ = ["ACTIVATIONS", "activation", "gelu"]


def gelu(x):
    """Exact GELU, x * Phi(x), written as torch writes it: 0.5 x (1 + erf(x / sqrt 2)). Not
    jax.nn.gelu(approximate=False): its erfc form expands to two polynomial branches and a select
    on XLA:CPU (docs/performance.md). Same function: the two differ by float rounding."""
    return x * (0.5 + 0.5 * jax.lax.erf(x * (2 ** -0.5)))


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu,  # torch nn.GELU() default: exact erf
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's "gelu_new"
}


def activation(name: str, h, impl: str = "auto"):
    """ACTIVATIONS[name](h), the exact GELU by the kernel ``impl`` picks (module docstring)."""
    use = native.use_kernel("act_impl", impl, ACT_IMPLS, h, gelu_ffi.unsupported, applies=name == "gelu")
    return policy.cpu_kernel(use, impl == "ffi", gelu_ffi.gelu, ACTIVATIONS[name], h, what="act_impl='ffi'")
