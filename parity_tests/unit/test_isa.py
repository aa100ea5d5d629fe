"""Capping the instruction sets (issue "every CPU"): scripts/harness.py::isa_env('avx2') makes torch,
XLA:CPU and jaxgpt's C++ kernels run as they would on an AVX2 machine, so an AVX-512 machine can
measure one (bench_train --isa avx2). Checked in a fresh process, since each framework reads its cap
when it starts: torch reports AVX2, the kernels' machine code has no AVX-512 (zmm) register, and the
AVX2-built attention kernel agrees with torch's SDPA at 1e-5 (float32, forward)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.nn.kernels import native
from scripts.harness import isa_env

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, subprocess, numpy as np, torch, torch.nn.functional as F
import jax, jax.numpy as jnp
from jaxgpt.nn.kernels import attend, native
so = native.build(native.CPU / "causal_attention.cc")
asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 37, 4, 32)).astype(np.float32) for _ in range(3))  # (B, T, H, D)
out = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), is_causal=True, impl="ffi"))
ref = F.scaled_dot_product_attention(*(torch.from_numpy(x).transpose(1, 2) for x in (q, k, v)),
                                     is_causal=True).transpose(1, 2).numpy()
print("RESULT " + json.dumps({"torch_isa": torch.backends.cpu.get_cpu_capability(), "so": str(so),
                              "zmm": "zmm" in asm, "ymm": "ymm" in asm, "err": float(np.abs(out - ref).max())}))
"""


def _child(isa: str, cache: Path) -> dict:
    env = {**os.environ, **isa_env(isa), "JAXGPT_CACHE": str(cache), "JAXGPT_HOST_DEVICES": "1"}
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_an_unknown_kernel_isa_is_refused(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="JAXGPT_KERNEL_ISA='avx9' is not one of"):
        native.isa_flags()
    with pytest.raises(ValueError, match="isa 'sse' is not one of"):
        isa_env("sse")


def test_isa_env_keeps_the_users_other_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX512")
    env = isa_env("avx2")
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    assert isa_env("native") == {}


@pytest.mark.slow  # a fresh process building the attention kernel: ~10 s
def test_avx2_cap_reaches_torch_and_the_kernels(tmp_path):
    capped = _child("avx2", tmp_path)
    assert capped["torch_isa"] == "AVX2"
    assert not capped["zmm"] and capped["ymm"], "the AVX2 build must use 256-bit registers and no AVX-512 ones"
    assert capped["err"] < 1e-5
    so = native.build(native.CPU / "causal_attention.cc")  # this process: the native build (what parity tests run)
    assert so.name != Path(capped["so"]).name, "the cache must key the build on its instruction sets"
    if "avx512f" in Path("/proc/cpuinfo").read_text():  # the cap did something here: native uses zmm
        asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert "zmm" in asm


MODEL = r"""
import jax, jax.numpy as jnp, numpy as np
from jaxgpt import PRESETS, Execution, build
cfg = PRESETS["gpt2-shakespeare-char"].replace(n_layer=1, d_model=64, n_head=2, max_len=128, dropout=0.0)
x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 128)), jnp.int32)  # (B, T): 32768 floats

def run(c, ex=None, execute=True):
    params = build(c, ex).init(jax.random.key(0), x)["params"]
    loss = lambda p: jnp.mean(jax.nn.log_softmax(build(c, ex).apply({"params": p}, x))[..., 0])
    f = jax.jit(jax.value_and_grad(loss))
    hlo = f.lower(params).as_text()
    if not execute:
        return "jaxgpt_" in hlo
    value, grads = f(params)
    return float(value), grads, "jaxgpt_" in hlo
"""

OFF_CHILD = MODEL + r"""
import json, warnings
warnings.simplefilter("always")

with warnings.catch_warnings(record=True) as w:
    auto = run(cfg)
xla = run(cfg, Execution(attention_impl="xla", norm_impl="xla", act_impl="xla"))
diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(auto[1]), jax.tree.leaves(xla[1])))
print("RESULT " + json.dumps({"kernel_in_hlo": auto[2], "loss_diff": abs(auto[0] - xla[0]), "grad_diff": diff,
                              "warnings": [str(m.message) for m in w if "kernel" in str(m.message)]}))
"""


def _off_child(extra: dict) -> dict:
    env = {**os.environ, "JAXGPT_HOST_DEVICES": "1", **extra}
    p = subprocess.run([sys.executable, "-c", OFF_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow  # a fresh process: ~15 s
def test_kernels_forced_off_fall_back_with_a_warning_to_xlas_numbers():
    """What a machine without the kernels (no compiler, an ISA they do not build for) gets: 'auto' runs
    XLA's ops, each unavailable kernel says so once, and the numbers are XLA's (self-consistency: the
    same model with every knob 'xla', <= 1e-6)."""
    off = _off_child({native.OFF_ENV: "off"})
    assert not off["kernel_in_hlo"]
    assert off["warnings"] and all("JAXGPT_KERNELS=off turns the C++ kernels off" in m for m in off["warnings"])
    assert len(off["warnings"]) == len(set(off["warnings"])), "each kernel warns once"
    assert off["loss_diff"] <= 1e-6 and off["grad_diff"] <= 1e-6
    scope: dict = {}
    exec(MODEL, scope)  # this process has the kernels: the same model's program calls one
    assert scope["run"](scope["cfg"], execute=False), "'auto' must run a kernel here, else this test proves nothing"
