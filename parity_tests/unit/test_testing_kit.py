"""jaxgpt.testing, the public parity kit: usable outside this checkout with nothing of the suite's (no
conftest, no compile flags), torch-free and side-effect-free to import, its parameter and gradient
mapping exact both ways, and check_module failing when the torch twin differs in a weight, in a
parameter gradient only, or in an input gradient only."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxgpt import build
from jaxgpt.config import ModelConfig
from jaxgpt.models import stacked_paths
from jaxgpt.nn.attention import Attention
from jaxgpt.nn.norms import RMSNorm
from jaxgpt.testing import (TOL, Comparison, Float64Comparison, assert_as_accurate_as_torch, assert_close,
                            check_module, grads_into, listening, load_into, random_params, randomize, torch_grads,
                            torch_params)
from torch_ref import build as tbuild
from torch_ref.nn.attention import Attention as TorchAttention
from torch_ref.nn.norms import RMSNorm as TorchRMSNorm

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter from a folder outside the checkout: jaxgpt's own import may set its
# host-device flag and jax's two logging variables; importing the kit on top must change nothing more.
OUTSIDE = textwrap.dedent("""
    import os, sys
    import jax, jaxgpt
    env, flags = dict(os.environ), dict(jax.config.values)
    import jaxgpt.testing
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    assert not changed, f"import jaxgpt.testing changed the environment: {changed}"
    assert dict(jax.config.values) == flags, "import jaxgpt.testing changed a jax flag"
    banned = sorted({"torch", "pytest", "conftest"} & {m.split(".")[0] for m in sys.modules})
    assert not banned, f"import jaxgpt.testing imported {banned}"
    assert "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    print("kit:", jaxgpt.testing.__file__)
    import parity_test
    sys.exit(parity_test.main())
""")


def test_kit_checks_attention_and_block_outside_the_checkout(tmp_path):
    """examples/parity_test.py (GQA + RoPE attention and a decoder block vs torch_ref, forward and gradients
    at 1e-5, public API only), run from a temporary folder in a subprocess with a clean environment."""
    shutil.copy(ROOT / "examples" / "parity_test.py", tmp_path / "parity_test.py")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", str(tmp_path)),
           "PYTHONPATH": str(ROOT)}  # this checkout's jaxgpt and torch_ref, as an install would provide them
    proc = subprocess.run([sys.executable, "-c", OUTSIDE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert f"kit: {ROOT / 'jaxgpt' / 'testing' / '__init__.py'}" in out, out
    for name in ("test_gqa_rope_attention", "test_decoder_block"):
        assert f"ok    {name}" in out, out
    for row in ("forward", "grad params", "grad inputs", "grad params vs float64"):
        assert f"decoder block {row} " in out, out


def _twins(cfg):
    """A 2-layer LLaMA-style DecoderLM (scanned layers) in both frameworks, with random weights."""
    ids = np.zeros((1, 4), np.int32)
    return random_params(build(cfg), ids, seed=3), tbuild(cfg), stacked_paths(cfg)


def _same_tree(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path


def test_params_and_grads_move_between_trees_and_torch_exactly():
    """load_into / torch_params and grads_into / torch_grads are exact inverses (stacked layers included),
    and land where torch keeps them: layer i's q_proj kernel (in, out) is torch's weight (out, in)."""
    cfg = ModelConfig(n_layer=2, d_model=16, n_head=4, n_kv_head=2, vocab_size=32, max_len=8, pos="rope",
                      norm="rmsnorm", mlp="swiglu")
    params, tmodel, stacked = _twins(cfg)
    assert stacked == ("layers",)
    load_into(tmodel, params, stacked)
    _same_tree(torch_params(tmodel, params, stacked), params)
    kernel = np.asarray(params["layers"]["attn"]["q_proj"]["kernel"])  # (n_layer, in, out)
    assert np.array_equal(tmodel.layers[1].attn.q_proj.weight.detach().numpy(), kernel[1].T)

    grads = randomize(params, seed=7)  # any tree shaped like the params
    grads_into(tmodel, grads, stacked)
    _same_tree(torch_grads(tmodel, params, stacked), grads)
    up = np.asarray(grads["layers"]["mlp"]["up_proj"]["kernel"])
    assert np.array_equal(tmodel.layers[0].mlp.up_proj.weight.grad.numpy(), up[0].T)
    assert torch_grads(tmodel, params, stacked, np.float64)["tok_embed"]["embedding"].dtype == np.float64

    del grads["norm"]
    with pytest.raises(ValueError, match=r"missing \['norm.scale'\], unexpected \[\]"):
        grads_into(tmodel, grads, stacked)


class _OffByOneWeight(TorchAttention):
    """torch_ref's attention, with one output-projection weight moved by 1e-3 after every load."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        with torch.no_grad():
            self.o_proj.weight[0, 0] += 1e-3
        return out


class _ScaleGradLost(TorchRMSNorm):
    """The same forward as torch_ref's RMSNorm, but its scale gets no gradient."""

    def forward(self, x):
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.scale.detach()


class _InputGradOfNormLost(TorchRMSNorm):
    """The same forward and scale gradient, but the input gradient misses the normaliser's part."""

    def forward(self, x):
        return x / torch.sqrt(x.detach().square().mean(-1, keepdim=True) + self.eps) * self.scale


@pytest.mark.parametrize("twin,message", [
    (_ScaleGradLost, r"kit twin grad params: max abs error \S+ \(divided by max\(1, max\|ref\|\)\) > tolerance 1e-05 "
                     r"\[leaf scale\]"),
    (_InputGradOfNormLost, r"kit twin grad inputs: max abs error \S+ \(divided by .*\) > tolerance 1e-05 \[input 0\]"),
], ids=["param-grad", "input-grad"])
def test_check_module_fails_when_only_a_gradient_differs(twin, message, scratch_tables):
    """Forward equal, one gradient wrong: check_module must compare gradients, leaf by leaf and per input."""
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    with pytest.raises(AssertionError, match=message):
        check_module("kit twin", RMSNorm(eps=1e-6), twin(16, eps=1e-6), [x])
    assert scratch_tables.WORST["parity"]["kit twin forward"] < TOL  # the forward passed first


def test_check_module_fails_when_the_twin_differs_in_one_weight(scratch_tables):
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    kw = dict(d_model=16, n_head=4, n_kv_head=2, rope=True)
    with pytest.raises(AssertionError, match=r"kit attention forward: max abs error \S+ > tolerance 1e-05"):
        check_module("kit attention", Attention(**kw), _OffByOneWeight(**kw), [x], select=lambda o: o[0])


def test_listeners_see_every_comparison_while_installed(scratch_tables):
    events = []
    with listening(events.append):
        assert_close([1.0, 2.0], [1.0, 2.0 + 4e-6], "kit probe")
        assert_as_accurate_as_torch([1.0 + 1e-6], [1.0 + 2e-6], [1.0], "kit probe f64", tol=1e-5)
    assert_close([1.0], [1.0], "kit probe after")  # no listener any more
    assert isinstance(events[0], Comparison) and events[0].component == "kit probe" and events[0].kind == "parity"
    assert abs(events[0].err - 4e-6) < 1e-9 and events[0].tol == TOL
    f64 = events[1]
    assert isinstance(f64, Float64Comparison) and f64.component == "kit probe f64" and f64.direct_asserted
    assert abs(f64.jaxgpt - 1e-6) < 1e-9 and abs(f64.torch - 2e-6) < 1e-9 and abs(f64.direct - 1e-6) < 1e-9
    assert [e.component for e in events[2:]] == ["kit probe f64", "kit probe f64 vs float64"]
    with pytest.raises(AssertionError, match=r"^kit probe: max abs error 1\.000e-04 > tolerance 1e-05$"):
        assert_close([0.0], [1e-4], "kit probe")
