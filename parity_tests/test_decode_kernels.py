"""The CPU kernels of a decode step: attention over the contiguous KV cache (paged_ffi.cached_attention,
cpu/paged_attention.cc) and the two-thread matvec of the projections (matvec_ffi.matvec, cpu/matvec.cc).

References the test did not compute itself: NumPy float64 (attention per query over its visible keys;
x @ w). Tolerances, absolute in float32: 1e-6 for attention; 1e-5 for the matvec, whose outputs (about 1)
are float32 sums of up to 1,536 products, about 1e-6 from float64 (XLA's dot is as far).
Whole models decoding through both kernels are checked against torch_ref in test_decoder.py and
test_generate.py, and against transformers in test_engine.py; here, which calls run them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference.generate import generate
from jaxgpt.models import abstract_params
from jaxgpt.nn import kernels
from jaxgpt.nn.kernels import matvec_ffi, paged_ffi

pytestmark = pytest.mark.skipif(not (paged_ffi.available() and matvec_ffi.available()),
                                reason="the CPU kernels cannot be built here")


def _attention_reference(q, k, v, offset):
    """q (B, T, H, D); k, v (B, H_kv, S, D); query t sees keys 0 .. min(offset + t, S - 1)."""
    b, t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        for j in range(t):
            n = min(offset + j, k.shape[2] - 1) + 1
            for hh in range(h):
                keys, vals = k[i, hh // g, :n].astype(np.float64), v[i, hh // g, :n].astype(np.float64)
                s = keys @ q[i, j, hh] / np.sqrt(d)
                w = np.exp(s - s.max())
                out[i, j, hh] = (w / w.sum()) @ vals
    return out


@pytest.mark.parametrize("layout", ["rows", "heads"])
@pytest.mark.parametrize("case", [dict(b=2, t=1, h=4, h_kv=2, d=24, s=300, offset=17),   # decode, GQA, D % 16 != 0
                                  dict(b=1, t=1, h=6, h_kv=6, d=64, s=1024, offset=1000),  # the benchmark's shape
                                  dict(b=3, t=5, h=4, h_kv=1, d=8, s=64, offset=40),     # a prefill chunk, MQA
                                  dict(b=1, t=1, h=2, h_kv=2, d=16, s=40, offset=0)],    # the first key alone
                         ids=["decode-gqa", "decode-long", "prefill-mqa", "first"])
def test_cached_attention_matches_numpy(case, layout):
    rng = np.random.default_rng(0)
    b, t, h, h_kv, d, s = (case[x] for x in ("b", "t", "h", "h_kv", "d", "s"))
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, h_kv, s, d)).astype(np.float32) for _ in range(2))
    want = _attention_reference(q, k, v, case["offset"])
    stored = (lambda a: a.reshape(b * h_kv, s, d)) if layout == "rows" else (lambda a: a)
    got = jax.jit(paged_ffi.cached_attention)(q, stored(k), stored(v), jnp.int32(case["offset"]))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=0)


def test_cached_attention_past_the_cache_sees_every_key_as_xla_does():
    """A query past the last slot (KVCache.write refuses the write; checked mode still runs the program):
    every key, as kernels/xla.py's causal mask gives it, not an error or a read past the buffer."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 2, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(2))
    got = paged_ffi.cached_attention(q, k, v, jnp.int32(7))  # positions 7 and 8 of 8 slots
    xla = kernels.xla.scaled_dot_product_attention(q, k, v, is_causal=True, q_offset=7, kv_layout="rows")
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got), _attention_reference(q, k.reshape(1, 2, 8, 16), v.reshape(1, 2, 8, 16), 7),
                               atol=1e-6, rtol=0)


def test_cached_attention_gradients_match_xla():
    """The kernel's VJP (kernels/xla.py's, at the cache offset it was given) against jax.grad of the
    einsum path with the same causal offset, in both layouts and past the cache."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 12, 16)).astype(np.float32)) for _ in range(2))
    dout = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))
    for layout, offset in (("heads", 4), ("rows", 4), ("rows", 10)):
        kk, vv = (k.reshape(4, 12, 16), v.reshape(4, 12, 16)) if layout == "rows" else (k, v)
        loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * dout)
        got = jax.grad(loss(lambda q, k, v: paged_ffi.cached_attention(q, k, v, jnp.int32(offset))), (0, 1, 2))(q, kk, vv)  # noqa: B023 - called in this iteration
        want = jax.grad(loss(lambda q, k, v: kernels.xla.scaled_dot_product_attention(
            q, k, v, is_causal=True, q_offset=offset, kv_layout=layout)), (0, 1, 2))(q, kk, vv)  # noqa: B023 - called in this iteration
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)


@pytest.mark.parametrize("m,k,n", [(1, 384, 1536), (4, 1536, 384), (3, 37, 50), (2, 301, 1000), (1, 3, 17)],
                         ids=["wide", "narrow", "odd-unsplit", "odd-split", "tiny"])
def test_matvec_matches_numpy(m, k, n):
    """Split over the helper thread (K x N >= 256K) or not, K not a multiple of 4, N not of 16."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    got = np.asarray(jax.jit(matvec_ffi.matvec)(x, w))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), atol=1e-5, rtol=0)
    again = np.asarray(jax.jit(matvec_ffi.matvec)(x, w))
    np.testing.assert_array_equal(got, again)  # self-consistency: each column summed in one fixed order


def test_matvec_gradients_match_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 300)).astype(np.float32)
    w = (rng.standard_normal((300, 500)) / np.sqrt(300)).astype(np.float32)
    dy = rng.standard_normal((2, 500)).astype(np.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(matvec_ffi.matvec(x, w) * dy), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(dx), dy.astype(np.float64) @ w.T.astype(np.float64), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(dw), x.T.astype(np.float64) @ dy.astype(np.float64), atol=1e-5, rtol=0)


def test_matvec_on_two_devices_at_once():
    """Both host devices call the kernel at the same time: one holds the helper thread, the other
    runs alone; each gets what one device alone computes, bit for bit (self-consistency)."""
    if jax.device_count() < 2:
        pytest.skip("one host device")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 1, 512)).astype(np.float32)
    w = (rng.standard_normal((512, 768)) / np.sqrt(512)).astype(np.float32)
    both = np.asarray(jax.pmap(matvec_ffi.matvec, in_axes=(0, None), devices=jax.devices()[:2])(x, w))
    for i in range(2):
        np.testing.assert_array_equal(both[i], np.asarray(jax.jit(matvec_ffi.matvec)(x[i], w)))


def test_matvec_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match=r"float32 x \(M, K\) and w \(K, N\); got bfloat16"):
        matvec_ffi.matvec(jnp.ones((1, 4), jnp.bfloat16), jnp.ones((4, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\(1, 4\) and float32 \(5, 2\)"):
        matvec_ffi.matvec(jnp.ones((1, 4)), jnp.ones((5, 2)))


SPY = ModelConfig(vocab_size=29, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_len=40, pos="rope")


@pytest.mark.parametrize("batch", [1, matvec_ffi.MAX_ROWS, matvec_ffi.MAX_ROWS + 1])
def test_generate_decodes_through_both_kernels(batch, monkeypatch):
    """Spies: generate()'s decode steps run the cache kernel and, up to MAX_ROWS rows, the matvec
    kernel for every projection (4 attention + 3 SwiGLU per layer); the 6-token prefill runs the cache
    kernel, and the matvec only where its rows are few enough (never here: batch x 6 > MAX_ROWS)."""
    cfg = SPY.replace(vocab_size=29 + batch)  # a config no other test compiles: generate() traces afresh
    p = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(0).standard_normal(a.shape).astype(np.float32) * .2),
                     abstract_params(cfg))  # (its shape-only init runs one row: before the spies)
    calls = {"matvec": set(), "attention": set()}
    real_mv, real_att = matvec_ffi.matvec, paged_ffi.cached_attention
    monkeypatch.setattr(matvec_ffi, "matvec", lambda x, w: calls["matvec"].add(x.shape[0]) or real_mv(x, w))
    monkeypatch.setattr(paged_ffi, "cached_attention",
                        lambda q, *a, **kw: calls["attention"].add(q.shape[1]) or real_att(q, *a, **kw))
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, 6))
    generate(cfg, p, prompt, 5)
    assert calls["attention"] == {6, 1}  # the prefill and the decode steps
    assert calls["matvec"] == ({batch} if batch <= matvec_ffi.MAX_ROWS else set())


@pytest.mark.parametrize("scan_layers", [False, True])
def test_matvec_only_for_layers_read_in_place(scan_layers, monkeypatch):
    """Separate layers (what generate() and the engine decode with) run the matvec kernel; scanned
    layers keep XLA's dot, which reads each layer's slice of the stacked weights in place (the custom
    call would copy it every step)."""
    from jaxgpt.models.decoder import DecoderLM, init_cache

    from jaxgpt.config import Execution

    cfg, ex = SPY.replace(vocab_size=23), Execution(scan_layers=scan_layers)
    p = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(cfg, ex))
    rows = []
    real = matvec_ffi.matvec
    monkeypatch.setattr(matvec_ffi, "matvec", lambda x, w: rows.append(x.shape[0]) or real(x, w))
    step = jax.jit(lambda p, c: DecoderLM(cfg, ex).apply({"params": p}, jnp.zeros((2, 1), jnp.int32), cache=c).logits)
    step(p, init_cache(cfg, 2, 8))
    assert rows == ([] if scan_layers else [2] * 7 * cfg.n_layer)  # q, k, v, o + gate, up, down
