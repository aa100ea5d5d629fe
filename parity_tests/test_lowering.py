"""The programs users compile, lowered from this CPU host for 'cpu', 'cuda' and 'tpu'.

Kernel choices are made per lowering platform (jaxgpt/nn/kernels/policy.py): a C++ CPU kernel
(custom call ``jaxgpt_*``) may appear only in the CPU program; the CUDA and TPU programs get the
portable paths. Each program is traced once on abstract inputs (jax.ShapeDtypeStruct, eval_shape:
nothing is allocated) and lowered three times; the test prints the custom calls each platform got.

What this host cannot show: cuDNN attention. JAX builds a cuDNN call only where cuDNN is installed
("cuDNN is not detected" here), so 'auto' stages cuDNN for CUDA on a GPU host only (kernels.attend,
policy.on_cuda); from this CPU host the CUDA program runs the portable 'blocked' kernel, which is
what this test checks lowers. No GPU or TPU runs here: the test proves the programs lower and carry
no CPU custom call, not that they compile on that hardware.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxgpt.config import TrainConfig
from jaxgpt.config.moe import MoEConfig
from jaxgpt.config.presets import PRESETS
from jaxgpt.inference.engine import paged_forward
from jaxgpt.inference.generate import _generate_cached
from jaxgpt.inference.packed_head import pack_head
from jaxgpt.inference.paged_cache import init_pools
from jaxgpt.models import abstract_params
from jaxgpt.nn.kernels import causal_ffi, native, norm_ffi, paged_ffi
from jaxgpt.train.step import init_state, make_train_step

PLATFORMS = ("cpu", "cuda", "tpu")
B, T = 8, 64  # 8 x 64 rows of d_model 64: native.AUTO_MIN_SIZE floats, so 'auto' picks the norm and GELU kernels
assert B * T * 64 >= native.AUTO_MIN_SIZE
GPT2 = PRESETS["gpt2-small"].replace(vocab_size=96, d_model=64, n_layer=2, n_head=4, max_len=T, dropout=0.0)
LLAMA = PRESETS["llama-tiny"].replace(vocab_size=96, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128,
                                      max_len=T)
MOE = LLAMA.replace(moe=MoEConfig(n_experts=4, top_k=2, d_ff=64))
EXACT_GELU = GPT2.replace(mlp="gelu")  # the exact GELU: the one the GELU kernel computes
CUSTOM_CALL = re.compile(r'(?:custom_call_target\s*=\s*|stablehlo\.custom_call\s+@)"?([\w$.\-]+)"?')


def _train(config, dtype: str, **over):
    config = config.replace(dtype=dtype, **over)
    tc = TrainConfig(batch_size=B, seq_len=T, steps=3)
    state = jax.eval_shape(lambda: init_state(config, tc, mesh=None))
    batch = {k: jax.ShapeDtypeStruct((1, B, T), jnp.int32) for k in ("x", "y")}
    return make_train_step(config, tc, mesh=None).trace(state, batch)


def _decode(config):
    """generate()'s cached program: prefill, then one decode step a token."""
    return _generate_cached.trace(abstract_params(config), jax.ShapeDtypeStruct((2, 8), jnp.int32),
                                  jax.ShapeDtypeStruct((2,), jnp.uint32), config=config, max_new_tokens=8,
                                  temperature=0.0, top_k=None, top_p=None, eos_id=None)


def _paged(config):
    """The engine's step (engine.paged_forward) with the kernels the Engine resolves on this host: the
    in-place paged attention and the packed panel head."""
    params = abstract_params(config)
    head = jax.eval_shape(functools.partial(pack_head, config), params)
    pools = jax.eval_shape(lambda: init_pools(config, 16, 8))
    rows, pages = 4, 4
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    kernel = paged_ffi.resolve_paged_kernel("auto", config.dtype, jnp.float32)
    return paged_forward.trace(params, pools, i32(rows, 1), i32(rows, 1), i32(rows, 1), i32(rows, pages), i32(rows),
                               head, config=config, kernel=kernel)


# name: (traced program, the CPU kernels 'auto' puts in its CPU program where they are built)
PROGRAMS = {
    "gpt2-train-bf16": (lambda: _train(GPT2, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd", "jaxgpt_norm_bwd")}),
    "llama-train-bf16": (lambda: _train(LLAMA, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd", "jaxgpt_norm_bwd")}),
    "moe-train-bf16": (lambda: _train(MOE, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd",)}),
    "gpt2-train-f32": (lambda: _train(EXACT_GELU, "float32"),
                       {norm_ffi: ("jaxgpt_norm_fwd",), causal_ffi: ("jaxgpt_causal_attention_fwd",)}),
    "decode-f32": (lambda: _decode(LLAMA.replace(scan_layers=False)), {paged_ffi: ("jaxgpt_cached_attention",)}),
    "paged-engine-f32": (lambda: _paged(LLAMA.replace(scan_layers=False)), {paged_ffi: ("jaxgpt_paged_attention",)}),
    # sliding windows: scanned layers mixing sliding and global ones (the window a scanned input), and the
    # engine's step with the window operand of the paged kernel
    "window-train-bf16": (lambda: _train(LLAMA.replace(sliding_window=8, window_layers=(1,)), "bfloat16"),
                          {norm_ffi: ("jaxgpt_norm_fwd",)}),
    "window-paged-f32": (lambda: _paged(LLAMA.replace(scan_layers=False, sliding_window=8)),
                         {paged_ffi: ("jaxgpt_paged_attention",)}),
}


def custom_calls(text: str) -> set[str]:
    """The custom-call targets in a lowered module's StableHLO text."""
    return set(CUSTOM_CALL.findall(text))


@functools.cache
def _lowered(name: str) -> dict[str, set[str]]:
    traced = PROGRAMS[name][0]()
    return {p: custom_calls(traced.lower(lowering_platforms=(p,)).as_text()) for p in PLATFORMS}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_lowers_for_every_platform_with_its_own_kernels(name):
    got = _lowered(name)
    print(f"\n{name}: " + "; ".join(f"{p}: {sorted(calls) or 'no custom call'}" for p, calls in got.items()))
    for p in PLATFORMS[1:]:
        cpu_only = sorted(c for c in got[p] if c.startswith("jaxgpt_"))
        assert not cpu_only, f"{name} lowered for {p} holds the CPU custom calls {cpu_only}"
    for module, targets in PROGRAMS[name][1].items():  # the CPU program still runs its kernels
        if module.available():
            assert set(targets) <= got["cpu"], f"{name} for the CPU lacks {targets}: {sorted(got['cpu'])}"


def test_explicit_cpu_kernel_is_refused_off_the_cpu():
    """norm_impl='ffi' is honoured on the CPU and refused, naming the knob, when lowered for a TPU."""
    if not norm_ffi.available():
        pytest.skip("the CPU norm kernel is not built here")
    traced = _train(LLAMA, "float32", norm_impl="ffi")
    assert "jaxgpt_norm_fwd" in custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text())
    with pytest.raises(ValueError, match=r"norm_impl='ffi' runs a C\+\+ CPU kernel, but this program is lowered for tpu"):
        traced.lower(lowering_platforms=("tpu",))
