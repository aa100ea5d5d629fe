"""Attention backends (``attention_impl``) behind the one entry ``kernels.attend``: 'jax' / 'cudnn'
(jax.nn.dot_product_attention) and 'blocked' (flash-style, kernels/blocked.py) against the einsum
path 'xla' and torch's SDPA, forward and gradients in float32 at 1e-5: causal, padding masks,
GQA / MQA, cross-attention, a cache decode step at a traced offset in both cache layouts, fully
masked rows (zeros on every backend), a whole DecoderLM; a spy proving which kernel runs in
training, prefill and decode; the cuDNN fallback's reasons; the dropout rule; and the blocked
backend's memory growing linearly in T (compiled memory_analysis)."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, assert_grads_close, assert_self_consistent, randomize
from jaxgpt import PRESETS, build
from jaxgpt.config import ATTENTION_IMPLS, Execution
from jaxgpt.inference.generate import generate
from jaxgpt.nn import kernels
from jaxgpt.nn.kernels import attend, blocked_attention, scaled_dot_product_attention as sdpa, warn_once
from jaxgpt.models import abstract_params, init_cache

IMPLS = ("jax", "blocked")  # 'cudnn' on a CPU is 'jax' plus a warning: test_cudnn_on_cpu_warns_once
BLOCK = 8  # small, so every case spans several blocks and a padded last block
pytestmark = pytest.mark.filterwarnings("ignore:attention_impl='cudnn' falls back")


def _qkv(b, tq, tk, h, hk, d=8, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((b, tq, h, d), (b, tk, hk, d), (b, tk, hk, d))]


def _key_mask(b, tk, seed=1, empty_batch=None):
    m = np.random.default_rng(seed).random((b, 1, 1, tk)) > 0.4
    m[..., 0] = True
    if empty_batch is not None:
        m[empty_batch] = False  # every query row of this batch element sees no key
    return jnp.asarray(m)


# name: (B, Tq, Tk, H, H_kv, causal, q_offset, mask kind)
CASES = {
    "causal": (1, 17, 17, 4, 1, True, 0, None),  # MQA
    "causal+padding,gqa": (2, 21, 21, 4, 2, True, 0, "keys"),
    "padding,cross": (2, 11, 26, 4, 2, False, 0, "keys"),
    "offset": (1, 5, 30, 4, 2, True, 13, None),  # a chunk of 5 queries after 13 cached positions
    "empty-rows": (2, 13, 13, 4, 2, False, 0, "empty"),
    "full-mask": (1, 12, 12, 2, 1, True, 0, "full"),  # (B, H, Tq, Tk): causal & random, some rows empty
}


def _case(name):
    b, tq, tk, h, hk, causal, off, kind = CASES[name]
    q, k, v = _qkv(b, tq, tk, h, hk)
    mask = None
    if kind == "keys":
        mask = _key_mask(b, tk)
    elif kind == "empty":
        mask = _key_mask(b, tk, empty_batch=1)
    elif kind == "full":
        m = np.random.default_rng(2).random((b, h, tq, tk)) > 0.6
        m[:, :, 3] = False
        mask = jnp.asarray(m)
    return (q, k, v), dict(mask=mask, is_causal=causal, q_offset=off)


def _out_and_grads(fn, qkv, kw):
    w = jnp.asarray(np.random.default_rng(3).standard_normal(qkv[0].shape), jnp.float32)  # a non-uniform cotangent

    def f(*qkv):
        out, vjp = jax.vjp(lambda *a: fn(*a, **kw), *qkv)
        return out, vjp(w)

    return jax.jit(f)(*qkv)  # one compile for the output and the gradients of q, k, v


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_backend_matches_xla(impl, case):
    qkv, kw = _case(case)
    ref, ref_g = _out_and_grads(sdpa, qkv, kw)
    out, g = _out_and_grads(lambda *a, **k: attend(*a, impl=impl, block=BLOCK, **k), qkv, kw)
    assert_self_consistent(out, ref, f"attention[{impl}] vs xla")
    for name, a, r in zip("qkv", g, ref_g):
        assert_self_consistent(a, r, f"attention[{impl}] vs xla d{name}", unit_scale=True)
    if case == "empty-rows":  # a query row with no visible key is exactly zero, not the mean of v
        assert float(jnp.abs(out[1]).max()) == 0.0 and float(jnp.abs(out[0]).min()) > 0.0
    if case == "full-mask":
        assert float(jnp.abs(out[:, 3]).max()) == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_backend_matches_torch_sdpa(impl):
    (q, k, v), kw = _case("causal+padding,gqa")
    tq, tk = q.shape[1], k.shape[1]
    allowed = np.asarray(kw["mask"]) & np.tril(np.ones((tq, tk), bool))  # every row keeps key 0
    qt, kt, vt = (torch.from_numpy(np.array(x)).transpose(1, 2) for x in (q, k, v))
    qt.requires_grad_(), kt.requires_grad_(), vt.requires_grad_()
    w = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)
    ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=torch.from_numpy(allowed),
                                         enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    (ref * torch.from_numpy(w)).sum().backward()
    out, g = _out_and_grads(lambda *a, **k: attend(*a, impl=impl, block=BLOCK, **k), (q, k, v), kw)
    assert_close(out, ref, f"attention[{impl}] vs torch SDPA")
    for name, a, r in zip("qkv", g, (qt, kt, vt)):
        assert_close(a, r.grad.transpose(1, 2), f"attention[{impl}] vs torch SDPA d{name}", unit_scale=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_cache_decode_step_traced_offset(impl):
    """The KV-cache layouts 'heads' (B, H_kv, S, D) and 'rows' (B * H_kv, S, D) with a traced write
    index and the 'written' mask, as Attention passes them; one token and a 3-token chunk."""
    b, h, hk, s, d = 2, 4, 2, 24, 8
    q, k, v = _qkv(b, 3, s, h, hk, d)
    cache = {"heads": [x.transpose(0, 2, 1, 3) for x in (k, v)],
             "rows": [x.transpose(0, 2, 1, 3).reshape(b * hk, s, d) for x in (k, v)]}

    def step(impl, layout, q, index):
        written = jnp.arange(s) < index + q.shape[1]
        return attend(q, *cache[layout], impl=impl, block=5, mask=written, is_causal=True, q_offset=index,
                      kv_layout=layout)

    run = jax.jit(step, static_argnums=(0, 1))
    for t, index in ((1, 9), (3, 17)):
        ref = run("xla", "heads", q[:, :t], jnp.int32(index))
        for layout in cache:
            got = run(impl, layout, q[:, :t], jnp.int32(index))
            assert_self_consistent(got, ref, f"attention[{impl}] cache step, {layout!r}")


@pytest.mark.cpu_only  # asserts cuDNN is absent
def test_cudnn_on_cpu_warns_once():
    warn_once.cache_clear()
    qkv, kw = _case("causal")
    ref, ref_g = _out_and_grads(sdpa, qkv, kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, g = _out_and_grads(lambda *a, **k: attend(*a, impl="cudnn", **k), qkv, kw)
    msgs = [str(w.message) for w in caught if "cudnn" in str(w.message)]
    assert msgs == ["attention_impl='cudnn' falls back to the XLA implementation: no GPU (JAX backend is 'cpu')"]
    assert_self_consistent(out, ref, "attention[cudnn] vs xla")
    for name, a, r in zip("qkv", g, ref_g):
        assert_self_consistent(a, r, f"attention[cudnn] vs xla d{name}", unit_scale=True)


@pytest.mark.cpu_only  # asserts cuDNN is absent
def test_cudnn_fallback_names_what_cudnn_raised(monkeypatch):
    """Past our own checks (pretend they pass), jax.nn's cuDNN path raises while tracing: here a
    RuntimeError (no cuDNN on a CPU); on a GPU NotImplementedError or ValueError for shapes it
    rejects. The fallback names the exception and runs 'xla'."""
    warn_once.cache_clear()
    monkeypatch.setattr(kernels.jax_sdpa, "cudnn_unsupported", lambda q: None)
    qkv, kw = _case("causal")
    qkv16 = [x.astype(jnp.float16) for x in qkv]
    with pytest.warns(UserWarning, match=r"attention_impl='cudnn' falls back to the XLA implementation: cuDNN "
                                         r"rejected the call \(RuntimeError: cuDNN is not detected.\)"):
        out = attend(*qkv16, impl="cudnn", **kw)
    assert_self_consistent(out.astype(jnp.float32), attend(*qkv16, impl="jax", **kw).astype(jnp.float32),
                           "attention[cudnn] fallback vs jax (float16)")


def test_weights_dropout_and_bad_impl():
    qkv, kw = _case("causal+padding,gqa")
    out, w = attend(*qkv, impl="blocked", return_weights=True, **kw)  # weights: the 'xla' path
    ref, ref_w = sdpa(*qkv, return_weights=True, **kw)
    assert_self_consistent(w, ref_w, "attention[blocked] weights")
    drop = dict(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0), **kw)
    for impl in ("jax", "cudnn", "blocked"):  # refused, never a silent switch to 'xla'
        with pytest.raises(ValueError, match=rf"attention_impl='{impl}' has no attention dropout \(dropout_rate=0.1\); "
                                             r"set attn_dropout=0.0 or attention_impl='xla'"):
            attend(*qkv, impl=impl, **drop)
    assert float(jnp.abs(attend(*qkv, impl="xla", **drop) - sdpa(*qkv, **kw)).max()) > 1e-3  # 'xla' drops
    with pytest.raises(ValueError, match=r"attention_impl='flash' is not one of"):
        attend(*qkv, impl="flash", **kw)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 21\)"):
        attend(*qkv, impl="blocked", mask=jnp.ones((2, 1, 21), bool))


def test_config_refuses_attention_dropout_off_xla():
    """Only 'xla' has attention dropout: any other kernel with a nonzero rate is refused when the
    model is built, naming the values (GPT-2's attn_dropout=None inherits dropout=0.1)."""
    with pytest.raises(ValueError, match=r"attention_impl='blocked' has no attention dropout, but attention dropout "
                                         r"is 0.1; set attn_dropout=0.0 or attention_impl='xla'"):
        build(TINY.replace(attn_dropout=0.1), Execution(attention_impl="blocked"))
    with pytest.raises(ValueError, match=r"attention_impl='cudnn' has no attention dropout, but attention dropout "
                                         r"is 0.1 \(attn_dropout=None takes dropout=0.1\)"):
        build(PRESETS["gpt2-small"], Execution(attention_impl="cudnn"))
    build(PRESETS["gpt2-small"].replace(attn_dropout=0.0), Execution(attention_impl="cudnn"))
    assert Execution().attention_impl == "auto"  # which picks 'xla' whenever the rate is > 0
    build(TINY.replace(attn_dropout=0.1))


def test_causal_only_skips_the_empty_row_fix():
    """Plain causal attention has no empty rows, so no any()-reduction is traced; a mask brings it back."""
    qkv, kw = _case("causal")
    for impl in ("xla", "jax"):
        causal = str(jax.make_jaxpr(lambda *a: attend(*a, impl=impl, is_causal=True))(*qkv))  # noqa: B023 - called in this iteration
        masked = str(jax.make_jaxpr(lambda *a: attend(*a, impl=impl, is_causal=True, mask=_key_mask(1, 17)))(*qkv))  # noqa: B023 - called in this iteration
        assert "reduce_or" not in causal and "reduce_or" in masked, impl


TINY = PRESETS["llama-tiny"].replace(vocab_size=48, d_model=32, n_head=4, n_kv_head=2, n_layer=2, d_ff=48, max_len=32)


@functools.cache
def _decoder_run(ex):
    """Logits and parameter gradients of a padded batch, and cached decoding (a 7-token prefill, then
    one token at a traced cache index), all in one compiled function."""
    p = randomize(abstract_params(TINY), 0)
    r = np.random.default_rng(0)
    x, y = (jnp.asarray(r.integers(0, 48, (2, 12)), jnp.int32) for _ in range(2))
    m = build(TINY, ex)

    def run(p):
        def loss(p):
            logits = m.apply({"params": p}, x, mask=_key_mask(2, 12))
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(p)
        first = m.apply({"params": p}, x[:, :7], cache=init_cache(TINY, 2, 16))
        nxt = m.apply({"params": p}, x[:, 7:8], cache=first.cache).logits
        return logits, grads, jnp.concatenate([first.logits, nxt], 1)

    return jax.jit(run)(p)


@pytest.mark.parametrize("impl", ["jax", "blocked", "ffi", "auto"])
def test_decoder_matches_xla(impl):
    ex = Execution(attention_impl=impl, attention_block=5)
    assert abstract_params(TINY, ex) == abstract_params(TINY)  # the knob changes no parameter
    logits, grads, decoded = _decoder_run(ex)
    ref_logits, ref_grads, ref_decoded = _decoder_run(Execution(attention_impl="xla"))
    assert_self_consistent(logits, ref_logits, f"DecoderLM[{impl}] logits")
    assert_grads_close(grads, ref_grads, f"DecoderLM[{impl}] grads", kind="self")
    assert_self_consistent(decoded, ref_decoded, f"DecoderLM[{impl}] cached decode")


SPY = TINY.replace(vocab_size=37, max_len=24)  # compiled by no other test, so generate() traces it afresh


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_configured_kernel_runs_in_training_prefill_and_decode(impl, monkeypatch):
    """A spy on every kernel: a training forward + backward, generate()'s prefill (Tq = the prompt)
    and its decode steps (Tq = 1) all run ``attention_impl`` and no other kernel; the tokens equal
    the default kernel's. (generate() used to prefill and decode with the einsum whatever the
    config said.)"""
    ran = set()

    def spy(module, name, label):
        real = getattr(module, name)

        def counted(q, *a, **kw):
            ran.add((label(kw), q.shape[1]))
            return real(q, *a, **kw)

        monkeypatch.setattr(module, name, counted)

    cfg, ex = SPY, Execution(attention_impl=impl, attention_block=4)
    p = randomize(abstract_params(cfg), 0)
    spy(kernels.xla, "scaled_dot_product_attention", lambda kw: "xla")
    spy(kernels.jax_sdpa, "jax_attention", lambda kw: kw["implementation"] or "jax")
    spy(kernels.blocked, "blocked_attention", lambda kw: "blocked")
    spy(kernels.causal_ffi, "causal_attention", lambda kw: "ffi")
    spy(kernels.paged_ffi, "cached_attention", lambda kw: "cache")
    # 'auto': the C++ kernels where they run (causal self-attention in training; prefill and decode
    # over the KV cache), else kernels.auto_impl's pick per call (here every key length exceeds the
    # block of 4); 'ffi' runs the same way
    # A C++ kernel 'auto' picks is staged beside its portable path (kernels/policy.py: what a program
    # lowered for another platform runs), so both are traced; an explicit 'ffi' stages the kernel alone.
    ffi, cache = kernels.causal_ffi.available(), kernels.paged_ffi.available()
    portable = lambda tq: {(kernels.auto_impl(tq, 12, 4), tq)}
    want = (lambda tq: {("cache", tq)} | portable(tq) if cache else portable(tq)) if impl in ("auto", "ffi") \
        else (lambda tq: {(impl, tq)})
    x = jnp.asarray(np.random.default_rng(0).integers(0, 37, (2, 12)), jnp.int32)
    jax.grad(lambda p: build(cfg, ex).apply({"params": p}, x, deterministic=False).sum())(p)
    train = {("ffi", 12)} | (portable(12) if impl == "auto" else set()) if impl in ("auto", "ffi") and ffi \
        else want(12)
    assert ran == train, "training"
    ran.clear()
    tokens = generate(cfg, p, x[:, :5], 4, execution=ex)
    assert ran == want(5) | want(1), "generate: prefill, decode"
    if impl != "xla":
        # the einsum's tokens; attention_block=5 (unused by 'xla') keeps this config apart from the
        # [xla] case's, which must still trace generate() afresh for its spy
        np.testing.assert_array_equal(tokens, generate(SPY, p, x[:, :5], 4,
                                                       execution=Execution(attention_impl="xla", attention_block=5)))


def _temp_bytes(fn, t, h=2, d=16):
    spec = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_blocked_memory_is_linear_in_t():
    """fwd+bwd temporaries at T=512 vs 2048 (4x): quadratic 'xla' grows ~16x, 'blocked' ~4x."""
    blocked = [_temp_bytes(lambda q, k, v: blocked_attention(q, k, v, is_causal=True, block=128), t)
               for t in (512, 2048)]
    xla = [_temp_bytes(lambda q, k, v: sdpa(q, k, v, is_causal=True), t) for t in (512, 2048)]
    assert xla[1] / xla[0] > 8, xla  # measured 9.5x
    assert blocked[1] / blocked[0] < 4.5, blocked  # measured 1.8x (a fixed part dominates)
    assert blocked[1] < xla[1] / 20, (blocked, xla)
