"""The generic, strict rule between Flax params and torch_ref state dicts, on NumPy arrays.

It lives in ``jaxgpt.core.layout`` (framework-free, so torch_ref can use it without importing JAX or
Flax) and is re-exported here, its home for the converters: see ``jaxgpt.core.layout`` for the rule
itself, its strict errors and the explicit float32 upcast of bf16/fp16 sources.
"""
from jaxgpt.core.layout import params_to_state_dict, state_dict_to_params, to_numpy

__all__ = ["params_to_state_dict", "state_dict_to_params", "to_numpy"]
