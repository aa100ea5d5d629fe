"""The GPU rules, checked on the CPU by faking the backend: the matmul precision policy (float32
compute gets full-precision float32 matmuls off the CPU, in every dot of a train step's forward and
backward, custom VJPs included), attention_impl='auto' per backend, and the logits head's backward
in the compute dtype. Programs are traced (jaxprs), not run, where the backend is faked.
On a real GPU, ``make test-gpu`` runs the parity suite itself under these rules."""
from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ACCELERATOR_SKIP, assert_self_consistent
from jaxgpt import build
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.models import abstract_params
from jaxgpt.nn import kernels
from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels.linear import logits as logits_matmul
from jaxgpt.nn.kernels import attend, auto_impl, warn_once

GPT = ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, max_len=16, pos="learned", norm="layernorm",
                  mlp="gelu", tie_embeddings=True)
GPU = Execution(attention_block=4, platform="cuda")  # 'auto' resolved for a CUDA program (jaxgpt.nn.kernels.exec_policy)


@pytest.fixture
def backend(monkeypatch):
    """Set what jax.default_backend() answers (only the jaxgpt rules read it; nothing is run on it).
    The answers jaxgpt caches per process (whether each C++ kernel is available, the step's compiler
    options) are asked first, on the real backend: asked under a faked one, they would be cached for
    every later test in this process (the CPU kernels 'unavailable' on the CPU)."""
    from jaxgpt.nn.kernels import causal_ffi, gelu_ffi, matvec_ffi, norm_ffi, paged_ffi
    from jaxgpt.train.compiled import compiler_options

    for cached in (causal_ffi.available, gelu_ffi.available, matvec_ffi.available, norm_ffi.available,
                   paged_ffi.available, compiler_options):
        cached()

    def set_to(name):
        monkeypatch.setattr(jax, "default_backend", lambda: name)
    return set_to


@pytest.mark.skipif(not os.environ.get("JAXGPT_EXPECT_BACKEND"),
                    reason=f"{ACCELERATOR_SKIP} make test-gpu sets JAXGPT_EXPECT_BACKEND")
def test_the_gpu_tier_runs_on_its_backend():
    """make test-gpu on a machine whose JAX sees no GPU fails here, instead of passing on the CPU."""
    assert jax.default_backend() == os.environ["JAXGPT_EXPECT_BACKEND"], jax.devices()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason=f"{ACCELERATOR_SKIP} XLA:GPU options")
def test_gpu_steps_compile_with_the_gpu_options():
    """On a GPU the train and eval steps take train.compiled.GPU_OPTIONS (cuBLAS GEMMs, no Triton GEMM)."""
    from jaxgpt.train import compiled

    assert compiled.compiler_options() == compiled.GPU_OPTIONS


def _dots(jaxpr):
    """Every dot_general equation in a closed jaxpr and its sub-jaxprs (scan, custom VJPs, pjit, ...)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in _params_jaxprs(eqn):
            yield from _dots(sub)


def _params_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _train_dots(cfg, ex=GPU):
    p = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg))
    x = jnp.zeros((2, 12), jnp.int32)
    loss = lambda p: build(cfg, ex).apply({"params": p}, x).astype(jnp.float32).sum()
    dots = list(_dots(jax.make_jaxpr(jax.grad(loss))(p).jaxpr))
    assert len(dots) >= 20  # q, k, v, o, fc_in, fc_out per layer forward and backward, attention, the head
    return [d.params["precision"] for d in dots]


def _highest(prec) -> bool:
    return prec is not None and all(p == jax.lax.Precision.HIGHEST for p in prec)


@pytest.mark.parametrize("impl", ["xla", "blocked"])
def test_float32_train_step_runs_every_matmul_at_full_precision_on_a_gpu(impl, backend):
    """matmul_precision='auto', float32, a faked GPU: every dot of the forward and backward pass is
    HIGHEST, those of the custom VJPs too (the tied head's, 'blocked' attention's), which are traced
    after the model call has returned."""
    backend("gpu")
    precs = _train_dots(GPT, GPU.replace(attention_impl=impl))
    assert all(_highest(p) for p in precs), precs


def test_precision_opt_outs_and_the_cpu(backend):
    """'default' leaves every dot at the backend default (TF32 on a GPU: opted in); bf16 compute and
    the CPU backend are left alone by 'auto' (so the CPU programs are the ones measured before)."""
    backend("gpu")
    assert not any(_highest(p) for p in _train_dots(GPT, GPU.replace(matmul_precision="default")))
    assert not any(_highest(p) for p in _train_dots(GPT.replace(dtype="bfloat16")))
    assert all(_highest(p) for p in _train_dots(GPT.replace(dtype="bfloat16"), GPU.replace(matmul_precision="highest")))
    backend("cpu")
    assert not any(_highest(p) for p in _train_dots(GPT, GPU.replace(platform="cpu")))


def test_precision_resolve_table():
    """Per target platform (the one the program is lowered for), not the machine tracing it."""
    assert precision.resolve("auto", "float32", "cuda") == "highest"
    assert precision.resolve("auto", "bfloat16", "cuda") is None
    assert precision.resolve("default", "float32", "cuda") is None
    assert precision.resolve("high", "bfloat16", "cuda") == "high"
    assert precision.resolve("auto", jnp.float32, "tpu") == "highest"
    assert precision.resolve("auto", "float32", "cpu") is None
    with pytest.raises(ValueError, match=r"matmul_precision='tf32' is not one of \('auto', 'default', 'high', 'highest'\)"):
        precision.resolve("tf32", "float32")
    with pytest.raises(ValueError, match="matmul_precision"):
        Execution(matmul_precision="tf32")


KERNELS = {"attend": lambda q: attend(q, q, q, impl="xla", is_causal=True),
           "sdpa": lambda q: kernels.scaled_dot_product_attention(q, q, q, is_causal=True),
           "blocked": lambda q: kernels.blocked_attention(q, q, q, is_causal=True, block=4),
           "jax": lambda q: kernels.jax_attention(q, q, q, is_causal=True)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_alone_use_the_policy(kernel, backend):
    """Called outside a model (as the parity tests call them), a float32 kernel still gets full
    precision on a GPU, in its backward pass too (the first GPU run of make test-gpu: direct
    scaled_dot_product_attention calls ran TF32, 1.3e-3 from torch)."""
    backend("gpu")
    q = jnp.zeros((1, 8, 2, 4), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: KERNELS[kernel](q).sum()))(q)
    precs = [d.params["precision"] for d in _dots(jaxpr.jaxpr)]
    assert precs and all(_highest(p) for p in precs), precs


def test_auto_attention_per_backend(backend):
    """'auto' on a GPU: cuDNN for a plain train-step call in bf16/fp16, 'blocked' (memory linear in
    T) for the other long calls, never (T, T) scores; the CPU's rule is unchanged."""
    bf16 = jax.ShapeDtypeStruct((2, 1024, 12, 64), jnp.bfloat16)
    f32 = jax.ShapeDtypeStruct((2, 1024, 12, 64), jnp.float32)
    odd = jax.ShapeDtypeStruct((2, 1024, 12, 60), jnp.bfloat16)  # head_dim not a multiple of 8
    backend("gpu")
    assert auto_impl(1024, 1024, 128, 0.0, bf16, plain=True) == "cudnn"
    assert auto_impl(1024, 1024, 128, 0.0, f32, plain=True) == "blocked"
    assert auto_impl(1024, 1024, 128, 0.0, odd, plain=True) == "blocked"
    assert auto_impl(1024, 1024, 128, 0.0, bf16, plain=False) == "blocked"  # a mask or a KV cache
    assert auto_impl(1, 1024, 128, 0.0, bf16) == "xla"  # a decode step
    assert auto_impl(1024, 1024, 128, 0.1, bf16, plain=True) == "xla"  # attention dropout
    backend("tpu")
    assert auto_impl(1024, 1024, 128, 0.0, bf16, plain=True) == "blocked"
    backend("cpu")
    assert auto_impl(1024, 1024, 128, 0.0, bf16, plain=True) == "blocked"
    assert auto_impl(64, 64, 128, 0.0, bf16, plain=True) == "xla"


def test_auto_attention_picks_cudnn_in_a_gpu_train_step(backend, monkeypatch):
    """The dispatch, traced: a bf16 train step on a faked GPU sends its attention to jax.nn's
    cuDNN implementation, and the float32 one to 'blocked'."""
    seen = []
    real = kernels.jax_sdpa._jax_attention
    monkeypatch.setattr(kernels.jax_sdpa, "_jax_attention", lambda *a, **k: seen.append(a[8]) or real(*a, **k))
    monkeypatch.setattr(kernels.blocked, "blocked_attention", lambda q, *a, **k: seen.append("blocked") or q)
    backend("gpu")
    for dtype in ("bfloat16", "float32"):
        cfg = GPT.replace(dtype=dtype)
        p = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg))
        try:
            jax.make_jaxpr(jax.grad(lambda p: build(cfg, GPU).apply({"params": p}, jnp.zeros((2, 12), jnp.int32)).sum()))(p)  # noqa: B023 - called in this iteration
        except Exception:  # noqa: BLE001 - tracing cuDNN's call on a CPU may fail past the dispatch
            pass
    assert seen[0] == "cudnn" and seen[-1] == "blocked", seen


@pytest.mark.cpu_only  # needs a cuDNN that rejects the call: none at all
@pytest.mark.parametrize("impl", ["auto", "ffi"])  # 'ffi' on a call its kernel cannot run: what 'auto' picks
def test_auto_falls_back_to_blocked_when_cudnn_rejects(impl, monkeypatch):
    """'auto' chose cuDNN but cuDNN raises while tracing (here: no cuDNN on a CPU): the call runs
    'blocked', never the (T, T) 'xla' path, with one warning naming what cuDNN raised."""
    warn_once.cache_clear()
    monkeypatch.setattr(kernels, "auto_impl", lambda *a, **k: "cudnn")
    monkeypatch.setattr(kernels.jax_sdpa, "cudnn_unsupported", lambda q: None)
    ran = []
    real = kernels.blocked.blocked_attention
    monkeypatch.setattr(kernels.blocked, "blocked_attention", lambda *a, **k: ran.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.bfloat16) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attend(q, k, v, impl=impl, block=4, is_causal=True)
    msgs = [str(w.message) for w in caught if "cuDNN" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith("attention_impl='auto' runs 'blocked' instead of cuDNN flash "
                                                 "attention: cuDNN rejected the call (RuntimeError"), msgs
    assert ran
    ref = attend(q, k, v, impl="xla", is_causal=True)
    assert_self_consistent(out.astype(jnp.float32), ref.astype(jnp.float32), "auto's cuDNN fallback vs xla (bf16)",
                           tol=2e-2)


def test_head_backward_runs_in_the_compute_dtype():
    """bf16 compute: the tied head's two backward matmuls read bf16 operands (a float32 cotangent
    against bf16 weights made float32 GEMMs: TF32 at best on a GPU), and accumulate in float32."""
    x = jnp.ones((6, 8), jnp.bfloat16)
    w = jnp.ones((11, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: logits_matmul(x, w, w_rows=True).sum(), argnums=(0, 1)))(x, w)
    dots = list(_dots(jaxpr.jaxpr))
    assert len(dots) == 3
    for d in dots:
        assert [v.aval.dtype for v in d.invars] == [jnp.bfloat16, jnp.bfloat16], d
        assert d.params["preferred_element_type"] == jnp.float32


@pytest.mark.parametrize("w_rows", [True, False])
def test_head_float32_matches_autodiff(w_rows):
    """Self-consistency: in float32 the custom VJP is JAX's own transpose (the cast is the identity)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((11, 8) if w_rows else (8, 11)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2, 5, 11)), jnp.float32)
    spec = "btd,vd->btv" if w_rows else "btd,dv->btv"
    ours = jax.value_and_grad(lambda x, w: (logits_matmul(x, w, w_rows=w_rows) * t).sum(), argnums=(0, 1))(x, w)
    ref = jax.value_and_grad(lambda x, w: (jnp.einsum(spec, x, w) * t).sum(), argnums=(0, 1))(x, w)
    assert_self_consistent(ours[0], ref[0], "head matmul vs einsum", tol=1e-4)
    for a, b, n in zip(ours[1], ref[1], "xw"):
        assert_self_consistent(a, b, f"head matmul vs einsum d{n}", unit_scale=True)
