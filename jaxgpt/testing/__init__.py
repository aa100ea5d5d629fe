"""jaxgpt.testing: the parity kit. Check a Flax module against its PyTorch twin, forward and gradients,
at float32's 1e-5, with a float64 reference for the cases where two float32 results differ by rounding.

    import numpy as np
    from jaxgpt.nn.attention import Attention
    from jaxgpt.testing import check_module
    from torch_ref.nn.attention import Attention as TorchAttention

    x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype(np.float32)
    kw = dict(d_model=32, n_head=4, n_kv_head=2, rope=True)
    check_module("GQA + RoPE attention", Attention(**kw), TorchAttention(**kw), [x],
                 jax_kwargs=dict(is_causal=True), torch_kwargs=dict(is_causal=True), select=lambda o: o[0])

The pieces, usable on their own:

- compare (``jaxgpt.testing.compare``): ``assert_close`` / ``assert_self_consistent`` (max abs error
  <= ``TOL``, optionally divided by max(1, max|ref|)), ``assert_grads_close`` (the gradient rule, leaf by
  named leaf), ``max_err``, ``scaled_err``, ``leaf_errors``, ``grads_err``, ``to_np``; every comparison is
  handed to the listeners installed with ``add_listener`` / ``listening`` (a suite's report tables);
- params (``jaxgpt.testing.params``): ``randomize`` / ``random_params`` (weights at unit-preserving
  scales), and between Flax trees and a torch twin, both ways: ``load_into`` / ``torch_params``
  (weights), ``torch_grads`` / ``grads_into`` (gradients);
- reference (``jaxgpt.testing.reference``): ``float64_torch``, ``float64_module``, ``to_float64`` and
  ``assert_as_accurate_as_torch`` (jaxgpt's float32 error against the twin in float64 <=
  max(tol, ``K64`` x the twin's own float32 error));
- modules (``jaxgpt.testing.modules``): ``check_module``, all of the above in one call.

Importing this package sets no environment variable or flag, and imports neither torch (the functions
that take torch objects import it when called; ``pip install 'jaxgpt[testing]'``) nor pytest: failures are
plain ``AssertionError``s naming the component, the error and the tolerance.
"""
from jaxgpt.testing.compare import (KINDS, TOL, Comparison, add_listener, assert_close, assert_grads_close,
                                    assert_self_consistent, grads_err, leaf_errors, listening, max_err, record,
                                    remove_listener, scaled_err, to_np)
from jaxgpt.testing.modules import check_module
from jaxgpt.testing.params import (grads_into, load_into, random_params, randomize, set_seed_offset, torch_grads,
                                   torch_params)
from jaxgpt.testing.reference import (K64, Float64Comparison, assert_as_accurate_as_torch, float64_module,
                                      float64_torch, to_float64)

__all__ = ["K64", "KINDS", "TOL", "Comparison", "Float64Comparison", "add_listener", "assert_as_accurate_as_torch",
           "assert_close", "assert_grads_close", "assert_self_consistent", "check_module", "float64_module",
           "float64_torch", "grads_err", "grads_into", "leaf_errors", "listening", "load_into", "max_err",
           "random_params", "randomize", "record", "remove_listener", "scaled_err", "set_seed_offset", "to_float64",
           "to_np", "torch_grads", "torch_params"]
