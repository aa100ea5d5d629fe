"""attention_impl='ffi' (kernels/causal_ffi.py, the C++ kernel in kernels/cpu/causal_attention.cc)
against torch's SDPA, forward and gradients in float32 at 1e-5: MHA, GQA and MQA, head sizes on
and off the kernel's register tiles (16/32/64/128, odd), lengths on and off its 8 x 32 score tiles and
16-float rows; a spy
proving the kernel ran; the calls it does not compute (mask, KV cache offset) running what 'auto'
picks; 'auto' choosing it for causal training; and the kernel split over two host devices."""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, assert_self_consistent
from jaxgpt.nn.kernels import attend, causal_ffi

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not causal_ffi.available(), reason="no C++ compiler: the kernel cannot be built")

# (B, T, H, H_kv, D)
SHAPES = {"mha,tiles": (3, 64, 4, 4, 32), "gqa,odd-length": (2, 21, 4, 2, 16), "mqa,d64": (1, 37, 4, 1, 64),
          "odd-head-size": (2, 9, 2, 2, 12), "several-tiles,d128": (2, 83, 2, 2, 128), "t256": (1, 256, 2, 1, 32)}


@pytest.fixture
def ran(monkeypatch):
    calls = []
    real = causal_ffi.causal_attention

    def counted(q, *a, **kw):
        calls.append(q.shape)
        return real(q, *a, **kw)

    monkeypatch.setattr(causal_ffi, "causal_attention", counted)
    return calls


def _qkv(b, t, h, hk, d, seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(np.float32) for s in ((b, t, h, d), (b, t, hk, d), (b, t, hk, d))]


@pytest.mark.parametrize("name", list(SHAPES))
def test_ffi_matches_torch_sdpa(name, ran):
    b, t, h, hk, d = SHAPES[name]
    q, k, v = _qkv(b, t, h, hk, d)
    w = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)  # a non-uniform cotangent
    qt, kt, vt = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != hk).transpose(1, 2)
    (ref * torch.from_numpy(w)).sum().backward()
    out, vjp = jax.vjp(jax.jit(lambda *a: attend(*a, impl="ffi", is_causal=True)), *map(jnp.asarray, (q, k, v)))
    assert ran, "the kernel did not run"
    assert_close(out, ref, f"attention[ffi] vs torch SDPA ({name})")
    for n, a, r in zip("qkv", vjp(jnp.asarray(w)), (qt, kt, vt)):
        assert_close(a, r.grad.transpose(1, 2), f"attention[ffi] vs torch SDPA d{n} ({name})", unit_scale=True)


def test_calls_it_does_not_compute_run_what_auto_picks(ran):
    """A mask or a cache offset: 'ffi' runs 'auto''s pick without the kernel, with the same numbers."""
    q, k, v = map(jnp.asarray, _qkv(2, 9, 2, 2, 8))
    mask = jnp.asarray(np.random.default_rng(1).random((2, 1, 1, 9)) > 0.3).at[..., 0].set(True)
    for kw in (dict(mask=mask, is_causal=True), dict(is_causal=True, q_offset=jnp.int32(0)), dict(is_causal=False)):
        got = attend(q, k, v, impl="ffi", **kw)
        assert_self_consistent(got, attend(q, k, v, impl="xla", **kw), f"attention[ffi] fallback {sorted(kw)}")
    assert not ran
    assert attend(q, k, v, impl="auto", is_causal=True) is not None and ran == [q.shape]  # 'auto' runs it


def test_ffi_over_two_host_devices_equals_one():
    """custom_partitioning runs the kernel on each device's rows (no gather), in a fresh process with
    two host devices: the loss and gradients of a batch split over them equal the one-device ones."""
    code = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxgpt.nn.kernels import attend
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((4, 24, 4, 16), (4, 24, 2, 16), (4, 24, 2, 16)))
f = lambda q, k, v: (attend(q, k, v, impl="ffi", is_causal=True) ** 2).sum()
g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
one = g(q, k, v)
mesh = Mesh(jax.devices(), ("data",))
sh = NamedSharding(mesh, P("data"))
lowered = g.lower(*(jax.device_put(x, sh) for x in (q, k, v)))
assert "all-gather" not in lowered.compile().as_text(), "the kernel's operands were gathered"
two = g(*(jax.device_put(x, sh) for x in (q, k, v)))
assert abs(float(one[0] - two[0])) <= 1e-6 * float(one[0]), (one[0], two[0])  # a sum of 6k squares: relative
err = max(float(jnp.abs(a - b).max()) for a, b in zip(one[1], two[1]))
assert err < 1e-5, err
print("ok", err)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
