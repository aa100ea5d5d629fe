"""The C++ CPU kernels behind norm_impl / act_impl 'ffi' (kernels/norm_ffi.py, kernels/gelu_ffi.py)
against torch, forward and gradients in float32 at 1e-5: LayerNorm with and without bias and RMSNorm,
rows on and off the kernel's 16-float vectors, ranks 2-4; the GELU over a grid from -12 to 12 and its
erf against float64; spies proving the kernels ran; 'auto' choosing them; the errors of 'ffi' where
it cannot run; both split over two host devices (the scale gradient summed across them). Also the
CPU Dense's kernel gradient taken in its wide (out, in) form."""
import math
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, assert_grads_close, assert_self_consistent, load_into, randomize, torch_grads
from jaxgpt import PRESETS, build
from jaxgpt.config import Execution
from jaxgpt.models import abstract_params, stacked_paths
from jaxgpt.nn import mlp, norms
from jaxgpt.nn.kernels import gelu_ffi, native, norm_ffi
from jaxgpt.nn.kernels.activation import activation
from torch_ref import build as tbuild

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (norm_ffi.available() and gelu_ffi.available()),
                                reason="no C++ compiler: the kernels cannot be built")

SHAPES = {"rows-384": (4, 7, 384), "odd-d": (3, 5, 37), "d16,one-row": (1, 1, 16), "rank2": (11, 40),
          "rank4": (2, 3, 4, 24)}


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(x, *a, **kw):
        calls.append(x.shape)
        return real(x, *a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _rand(shape, seed, scale=1.0, shift=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + shift).astype(np.float32)


@pytest.mark.parametrize("kind", ["layernorm", "layernorm-nobias", "rmsnorm"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_norm_ffi_matches_torch(name, kind, monkeypatch):
    shape = SHAPES[name]
    d = shape[-1]
    x, dy = _rand(shape, 0, 3.0, 1.0), _rand(shape, 1)  # off-centre rows; a non-uniform cotangent
    w, b = _rand((d,), 2, 0.5, 1.0), _rand((d,), 3)
    xt, wt, bt = (torch.from_numpy(a).requires_grad_() for a in (x, w, b))
    eps = 1e-5 if kind != "rmsnorm" else 1e-6
    if kind == "rmsnorm":
        ref = F.rms_norm(xt, (d,), wt, eps)
        module, params = norms.RMSNorm(eps=eps, impl="ffi"), {"scale": w}
    else:
        bias = kind == "layernorm"
        ref = F.layer_norm(xt, (d,), wt, bt if bias else None, eps)
        module = norms.LayerNorm(eps=eps, use_bias=bias, impl="ffi")
        params = {"scale": w, **({"bias": b} if bias else {})}
    (ref * torch.from_numpy(dy)).sum().backward()
    calls = _spy(monkeypatch, norm_ffi, "_norm")
    y, vjp = jax.vjp(jax.jit(lambda p, x: module.apply({"params": p}, x)), jax.tree.map(jnp.asarray, params),
                     jnp.asarray(x))
    assert calls, "the kernel did not run"
    assert_close(y, ref, f"{kind}[ffi] vs torch ({name})")
    dp, dx = vjp(jnp.asarray(dy))
    assert_close(dx, xt.grad, f"{kind}[ffi] vs torch dx ({name})", unit_scale=True)
    assert_close(dp["scale"], wt.grad, f"{kind}[ffi] vs torch dscale ({name})", unit_scale=True)
    if "bias" in dp:
        assert_close(dp["bias"], bt.grad, f"{kind}[ffi] vs torch dbias ({name})", unit_scale=True)


def test_gelu_ffi_matches_torch_and_float64():
    x = np.linspace(-12, 12, 48001, dtype=np.float32)
    dy = _rand(x.shape, 4)
    xt = torch.from_numpy(x).requires_grad_()
    ref = F.gelu(xt)  # exact (erf) GELU
    (ref * torch.from_numpy(dy)).sum().backward()
    y, vjp = jax.vjp(jax.jit(gelu_ffi.gelu), jnp.asarray(x))
    assert_close(y, ref, "gelu[ffi] vs torch")
    assert_close(vjp(jnp.asarray(dy))[0], xt.grad, "gelu[ffi] vs torch dx")
    # the kernel's erf and exp alone, against float64: Phi(x) = y / x, Phi'(x) = dx - Phi(x) per unit dy
    phi = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    slope = phi + x * np.exp(-0.5 * x.astype(np.float64) ** 2) / math.sqrt(2 * math.pi)
    got_slope = np.asarray(jax.vjp(gelu_ffi.gelu, jnp.asarray(x))[1](jnp.ones_like(jnp.asarray(x)))[0])
    assert_close(got_slope, slope, "gelu[ffi] slope vs float64", tol=3e-7)
    assert_close(np.asarray(y)[x != 0] / x[x != 0], phi[x != 0], "gelu[ffi] Phi vs float64", tol=3e-7)


def test_gelu_ffi_in_the_mlp_matches_xla_and_auto_runs_it(monkeypatch):
    """Self-consistency: the MLP with act_impl 'ffi' / 'auto' equals 'xla''s, gradients too."""
    x = jnp.asarray(_rand((4, 64, 16), 5))  # a hidden layer of 4 * 64 * 128 floats: 'auto''s lower bound
    assert 4 * 64 * 128 == native.AUTO_MIN_SIZE
    ref = mlp.MLP(d_model=16, d_ff=128, act_impl="xla")
    params = ref.init(jax.random.PRNGKey(0), x)
    loss = lambda m: jax.value_and_grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x))))(params)
    want = loss(ref)
    calls = _spy(monkeypatch, gelu_ffi, "gelu")
    for impl in ("ffi", "auto"):
        got = loss(mlp.MLP(d_model=16, d_ff=128, act_impl=impl))
        assert_self_consistent(got[0], want[0], f"MLP act_impl={impl} vs xla: loss")
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            assert_self_consistent(a, b, f"MLP act_impl={impl} vs xla: grads")
    assert len(calls) == 2
    calls.clear()
    mlp.MLP(d_model=16, d_ff=128, activation="gelu_tanh").apply(params, x)  # not the exact GELU: XLA
    mlp.MLP(d_model=16, d_ff=128).apply(params, x[:, :63])  # under AUTO_MIN_SIZE (a decode step): XLA
    assert not calls


def test_auto_runs_the_norm_kernel_and_ffi_refuses_what_it_cannot(monkeypatch):
    calls = _spy(monkeypatch, norm_ffi, "_norm")
    x = jnp.ones((2, 64, 256))
    assert x.size == native.AUTO_MIN_SIZE
    norms.LayerNorm().init(jax.random.PRNGKey(0), x)
    assert calls, "norm_impl='auto' did not run the kernel on the CPU"
    calls.clear()
    norms.LayerNorm(impl="xla").init(jax.random.PRNGKey(0), x)
    norms.LayerNorm().init(jax.random.PRNGKey(0), x[:, :63])  # under AUTO_MIN_SIZE (a decode step): XLA
    assert not calls
    with pytest.raises(ValueError, match=r"norm_impl='ffi' cannot run here: it takes x of rank 2"):
        norms.LayerNorm(impl="ffi").init(jax.random.PRNGKey(0), jnp.ones((8,)))
    with pytest.raises(ValueError, match=r"act_impl='ffi' cannot run here: it computes in float32"):
        activation("gelu", jnp.ones((4,), jnp.bfloat16), "ffi")
    with pytest.raises(ValueError, match=r"norm_impl='fused' is not one of"):
        norms.LayerNorm(impl="fused").init(jax.random.PRNGKey(0), x)


def test_gpt2_with_both_kernels_matches_torch_ref(monkeypatch):
    """A tiny GPT-2 (LayerNorm with bias, exact GELU) with norm_impl = act_impl = 'ffi': logits and
    next-token cross-entropy gradients against torch_ref's, 1e-5."""
    cfg = PRESETS["gpt2-small"].replace(vocab_size=48, d_model=32, n_head=4, n_layer=2, max_len=16, mlp="gelu", dropout=0.0)
    ex = Execution(norm_impl="ffi", act_impl="ffi")
    p = randomize(abstract_params(cfg), 0)
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    x, y = tok[:, :-1], tok[:, 1:]
    norm_calls, gelu_calls = _spy(monkeypatch, norm_ffi, "_norm"), _spy(monkeypatch, gelu_ffi, "_gelu")

    def loss(p):
        logits = build(cfg, ex).apply({"params": p}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
    assert norm_calls and gelu_calls, "the kernels did not run"
    t = load_into(tbuild(cfg), p, stacked_paths(cfg))
    tlogits = t(torch.from_numpy(x))
    assert_close(logits, tlogits, "GPT-2 norm/act_impl=ffi logits vs torch_ref")
    F.cross_entropy(tlogits.flatten(0, 1), torch.from_numpy(y).long().flatten()).backward()
    assert_grads_close(grads, torch_grads(t, p, stacked_paths(cfg)), "GPT-2 norm/act_impl=ffi grads vs torch_ref")


def test_dense_takes_the_wide_kernel_gradient_on_the_cpu():
    """For in > out the CPU Dense computes the kernel gradient as (out, in) = dy^T x and transposes it
    (Eigen's faster form); the gradients equal lax.dot_general's (self-consistency), and the compiled
    backward holds that dot."""
    x = jnp.asarray(_rand((2, 5, 48), 6))
    for feats in (16, 96):
        m = mlp.Dense(feats)
        p = m.init(jax.random.PRNGKey(0), x)
        grads = lambda mod: jax.grad(lambda p, x: jnp.sum(jnp.sin(mod.apply(p, x))), argnums=(0, 1))  # noqa: B023 - called in this iteration
        got, want = grads(m)(p, x), grads(nn.Dense(feats))(p, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_self_consistent(a, b, f"Dense {48}->{feats} grads vs nn.Dense")
        assert _wide_kernel_gradient(grads(m), p, x, 48, feats) == (feats < 48), f"kernel gradient form, 48 -> {feats}"
        assert not _wide_kernel_gradient(grads(nn.Dense(feats)), p, x, 48, feats)  # what XLA does by itself


def _wide_kernel_gradient(fn, p, x, n_in, n_out) -> bool:
    """Whether the compiled fn computes a dot whose result lies in memory as (out, in) rows."""
    hlo = jax.jit(fn).lower(p, x).compile().as_text()
    return f"f32[{n_out},{n_in}]{{1,0}} dot(" in hlo or f"f32[{n_in},{n_out}]{{0,1}} dot(" in hlo


def test_kernels_over_two_host_devices_equal_one():
    """custom_partitioning runs both kernels on each device's rows, in a fresh process with two host
    devices: a LayerNorm + GELU loss and its gradients (the scale's summed over the devices) over a
    batch split in two equal the one-device ones."""
    code = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxgpt.nn.kernels import gelu_ffi, norm_ffi
r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((4, 6, 40)), jnp.float32)
w, b = (jnp.asarray(r.standard_normal((40,)), jnp.float32) for _ in range(2))
f = lambda x, w, b: (gelu_ffi.gelu(norm_ffi.layer_norm(x, w, b, eps=1e-5)) ** 2).sum()
g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
one = g(x, w, b)
mesh = Mesh(jax.devices(), ("data",))
args = (jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(w, NamedSharding(mesh, P())),
        jax.device_put(b, NamedSharding(mesh, P())))
assert "all-gather" not in g.lower(*args).compile().as_text(), "the kernels' operands were gathered"
two = g(*args)
assert abs(float(one[0] - two[0])) <= 1e-6 * float(one[0]), (one[0], two[0])
# gradients at unit scale (the scale's and bias's are sums over 24 rows): a scale gradient summed twice,
# or not summed across the devices, is off by about half of itself
err = max(float(jnp.abs(a - b).max() / max(1.0, float(jnp.abs(a).max()))) for a, b in zip(one[1], two[1]))
assert err < 1e-5, err
print("ok", err)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
