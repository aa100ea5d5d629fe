"""The test suite's root conftest: float32 everywhere, full-precision matmuls, the same weights on both
sides (copied through the converter), and the error tables printed at the end of the run.

The tests are grouped by kind: ``parity_tests/`` holds the cross-framework parity tests (jaxgpt against
torch_ref, torch, Hugging Face and the seeds' code), ``unit/`` the unit tests, ``engine/`` the decoding
engine and the server, ``cli/`` the command line and other whole runs, ``experiments/`` the experiment
and benchmark scripts. The harness is three plugins under ``plugins/``, loaded here (``pytest_plugins``):

- ``xla_flags``: the tests' compile flags and compilation cache, set before JAX starts (imported first),
  the ``users_flags`` and ``same_bits`` markers' hooks;
- ``report``: the parity and self-consistency tables and the float64 margins file;
- ``fixtures``: the skip rules (``require_shared``, ``require_module``, CI's one accepted skip, ``cpu_only``)
  and the shared fixtures.

The comparison helpers (``assert_close``, ``check_module``, ``randomize``, the float64 reference, ...) are
the public parity kit, ``jaxgpt.testing``; the tests import them, and the plugins' helpers, from here
(``from conftest import assert_close, require_module``).

One tolerance rule: float32 forward 1e-5 max abs; gradients (``assert_grads_close``, and the gradients in
``check_module``) 1e-5 max abs after dividing by max(1, max|g_ref|) per leaf.

The float64 reference (``check_module``, ``assert_as_accurate_as_torch``): two float32 results of a
multi-layer gradient can differ by ~1e-5 through rounding alone, and by how much depends on the CPU's
kernels. So the models' gradients are judged against torch_ref run in float64 on the same weights and
inputs: jaxgpt's float32 error must be <= max(1e-5, K64 x torch_ref float32's own error against that
float64 result; ``jaxgpt.testing.reference``). The measured margins are in docs/parity-margins.md
(``make parity-margins`` regenerates it: JAXGPT_PARITY_MARGINS=<file>).
"""
from __future__ import annotations

import sys

import pytest

if "parity_tests.plugins" not in sys.modules:  # imported here, before pytest loads them: rewrite their asserts too
    pytest.register_assert_rewrite("parity_tests.plugins")

from parity_tests.plugins.xla_flags import (LEGACY_EMITTERS, TEST_XLA_FLAGS, users_flags,  # noqa: F401 - first:
                                            xla_flags)  # it sets XLA_FLAGS before JAX starts
from parity_tests.plugins.fixtures import (ACCELERATOR_SKIP, SHARED, on_ci, require_module,  # noqa: F401
                                           require_shared, seed_classes)
from parity_tests.plugins.report import SEED_OFFSET  # noqa: F401
from jaxgpt.testing import (K64, TOL, add_listener, assert_as_accurate_as_torch, assert_close,  # noqa: F401
                            assert_grads_close, assert_self_consistent, check_module, float64_module, float64_torch,
                            grads_err, load_into, max_err, random_params, randomize, record, set_seed_offset,
                            to_float64, to_np, torch_grads)

pytest_plugins = ("parity_tests.plugins.xla_flags", "parity_tests.plugins.report", "parity_tests.plugins.fixtures")
