"""The CPU PagedAttention kernel (jaxgpt/nn/kernels/paged_ffi.py, cpu/paged_attention.cc).

References the test did not compute itself: causal softmax attention per query in float64 NumPy
over each row's keys, laid out contiguously by the test, and the pure-JAX path (gather, then
kernels.attend). Tolerance: 1e-6 absolute in float32 (the kernel sums in another order).
The engine's greedy tokens with the kernel are checked against transformers in test_engine.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.inference import paged_cache
from jaxgpt.inference.paged_cache import resolve_paged_kernel
from jaxgpt.nn.kernels import attend, paged_ffi
from jaxgpt.nn.kernels.paged import PagedKVCache

pytestmark = pytest.mark.skipif(not paged_ffi.available(), reason="the CPU kernel cannot be built here")


def _case(seed, b, t, h, h_kv, d, ps=4, p=5):
    """Random pools, a page table of distinct pages per row, ragged query positions (-1: padding)."""
    rng = np.random.default_rng(seed)
    n_pages = b * p + 4  # page 0 is scratch, and a few pages belong to no row
    k_pool, v_pool = (rng.standard_normal((n_pages, h_kv, ps, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, n_pages))[:b * p].reshape(b, p).astype(np.int32)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    start = rng.integers(0, p * ps - t + 1, b)
    q_pos = (start[:, None] + np.arange(t)[None]).astype(np.int32)
    q_pos[-1, t // 2:] = -1  # a padded tail
    if b > 2:
        q_pos[1] = -1  # a padding row
    return q, k_pool, v_pool, table, q_pos


def _numpy_reference(q, k_pool, v_pool, table, q_pos):
    b, t, h, d = q.shape
    h_kv = k_pool.shape[1]
    out = np.zeros((b, t, h, d))
    for i in range(b):
        keys = k_pool[table[i]].transpose(1, 0, 2, 3).reshape(h_kv, -1, d).astype(np.float64)  # (H_kv, S, D)
        vals = v_pool[table[i]].transpose(1, 0, 2, 3).reshape(h_kv, -1, d).astype(np.float64)
        for j in range(t):
            n = q_pos[i, j] + 1
            for hh in range(h):
                kv = hh // (h // h_kv)
                s = keys[kv, :n] @ q[i, j, hh] / np.sqrt(d)
                w = np.exp(s - s.max()) if n else s
                out[i, j, hh] = (w / w.sum()) @ vals[kv, :n] if n else 0.0
    return out


@pytest.mark.parametrize("shape", [dict(b=5, t=1, h=4, h_kv=2, d=24),    # decode, GQA, D not a multiple of 16
                                   dict(b=3, t=6, h=4, h_kv=4, d=32),    # a prefill chunk, MHA
                                   dict(b=2, t=3, h=6, h_kv=1, d=8)],    # MQA, D below one 16-lane block
                         ids=["decode-gqa", "prefill-mha", "mqa"])
def test_kernel_matches_numpy_and_the_gather_path(shape):
    q, k_pool, v_pool, table, q_pos = _case(0, **shape)
    got = np.asarray(jax.jit(paged_ffi.paged_attention)(q, k_pool, v_pool, table, q_pos))
    np.testing.assert_allclose(got, _numpy_reference(q, k_pool, v_pool, table, q_pos), atol=1e-6, rtol=0)

    cache = PagedKVCache(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table),
                         jnp.zeros(q_pos.shape, jnp.int32), jnp.asarray(q_pos))
    keys, values, mask = cache.gather()
    gathered = np.asarray(attend(jnp.asarray(q), keys, values, impl="xla", mask=mask, kv_layout="rows"))
    np.testing.assert_allclose(got, gathered, atol=1e-6, rtol=0)
    # attend's 'pages' layout: the kernel in place (the same call), or the gathered pages for the weights
    pages = (jnp.asarray(table), jnp.asarray(q_pos))
    in_place = attend(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), kv_layout="pages", pages=pages)
    np.testing.assert_array_equal(np.asarray(in_place), got)
    out, weights = attend(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), kv_layout="pages", pages=pages,
                          return_weights=True)
    np.testing.assert_allclose(np.asarray(out), gathered, atol=1e-6, rtol=0)
    assert weights.shape == (shape["b"], shape["h"], shape["t"], table.shape[1] * k_pool.shape[2])


def test_the_caches_share_one_contract():
    """KVCache and PagedKVCache (both kernels) implement nn/kv_cache.py's contract: offset, room, write ->
    the cache, read -> a KVRead (keys, values, kv_layout, mask, is_causal, window), what attend takes;
    the paged cache's 'ffi' gives its pools as layout 'pages'."""
    from jaxgpt.nn.kv_cache import KVCache, KVRead

    q, k_pool, v_pool, table, q_pos = _case(2, b=2, t=1, h=2, h_kv=2, d=8)
    k_new = jnp.ones((2, 1, 2, 8))
    slots = jnp.asarray(table[:, :1] * k_pool.shape[2])
    for kernel, layout in (("ffi", "pages"), ("gather", "rows")):
        cache = PagedKVCache(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table), slots, jnp.asarray(q_pos),
                             kernel=kernel)
        assert cache.offset is None  # each row starts at its own position: the caller passes them
        written = cache.write(k_new, k_new)
        kv = written.read()
        assert isinstance(written, PagedKVCache) and isinstance(kv, KVRead) and kv.layout == layout, (kernel, kv.layout)
        assert (kv.mask is None) == (kernel == "ffi") and kv.is_causal == (kernel == "ffi")
        with pytest.raises(ValueError, match="builds its own mask"):
            written.read(mask=jnp.ones((1, 1, 1, 1), bool))
        with pytest.raises(ValueError, match="write slots for 1 tokens a row was given 2"):
            cache.room(2)
    contiguous = KVCache.init(2, 2, 8, 8)
    c = contiguous.write(k_new, k_new)
    kv = c.read()
    assert (int(c.index), int(c.offset), kv.k.shape, kv.layout, kv.mask, kv.is_causal) == (1, 1, (2, 2, 8, 8), "heads",
                                                                                            None, True)
    np.testing.assert_array_equal(np.asarray(c.read(is_causal=False).mask), np.arange(8) < 1)  # the written slots only
    with pytest.raises(ValueError, match="KV cache overflow: 1 cached"):
        c.room(8)


def test_kernel_refuses_a_position_past_the_page_table():
    q, k_pool, v_pool, table, q_pos = _case(1, b=2, t=1, h=2, h_kv=2, d=8)
    q_pos[0, 0] = table.shape[1] * k_pool.shape[2]  # one past the row's last slot
    with pytest.raises(Exception, match="past its page table"):
        np.asarray(paged_ffi.paged_attention(q, k_pool, v_pool, table, q_pos))


def test_resolve_paged_kernel(monkeypatch):
    """'auto' stays 'auto' (each lowering platform picks its kernel), warning once per reason where
    this machine's platform gathers; an explicit kernel that cannot run is an error."""
    import warnings

    paged_cache._fallback_warning.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel runs: nothing to say
        assert resolve_paged_kernel("auto", "float32", jnp.float32) == "auto"
        assert resolve_paged_kernel("gather", "float32", jnp.float32) == "gather"  # asked for: no warning
        assert resolve_paged_kernel("pallas", "bfloat16", jnp.int8) == "pallas"  # interpreted on the CPU
    with pytest.warns(UserWarning, match="runs 'gather'.*float32 pages in a float32 model"):
        assert resolve_paged_kernel("auto", "float32", jnp.int8) == "auto"  # int8 pages: the JAX path dequantises
    with pytest.warns(UserWarning, match="dtype=bfloat16, pages bfloat16"):
        assert resolve_paged_kernel("auto", "bfloat16", jnp.bfloat16) == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        assert resolve_paged_kernel("auto", "bfloat16", jnp.bfloat16) == "auto"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU: the Pallas kernel, where it takes the shapes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_paged_kernel("auto", "bfloat16", jnp.int8) == "auto"
    with pytest.warns(UserWarning, match="head_dim 24 and page_size 16 must be"):
        assert resolve_paged_kernel("auto", "float32", jnp.float32, head_dim=24) == "auto"
    with pytest.raises(ValueError, match="'ffi' cannot run: it is a CPU kernel and this backend is 'gpu'"):
        resolve_paged_kernel("ffi", "float32", jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a TPU: the ragged kernel (tpu_ragged.py) reads float32 pools too
        assert resolve_paged_kernel("auto", "float32", jnp.float32) == "auto"
    with pytest.warns(UserWarning, match=r"pools \(got float16\)"):
        assert resolve_paged_kernel("auto", "float16", jnp.float16) == "auto"
    with pytest.raises(ValueError, match="'pallas' cannot run: it runs on CUDA"):
        resolve_paged_kernel("pallas", "float32", jnp.float32)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="float32 pages"):
        resolve_paged_kernel("ffi", "bfloat16", jnp.bfloat16)
    with pytest.raises(ValueError, match="not one of"):
        resolve_paged_kernel("triton", "float32", jnp.float32)


def test_without_a_compiler_the_engine_gathers(tmp_path):
    """A fresh interpreter with no compiler and an empty cache: one warning, and 'auto' gathers on the CPU."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from jaxgpt.nn.kernels import paged_ffi\n"
            "from jaxgpt.inference.paged_cache import resolve_paged_kernel\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    print(paged_ffi.available(), resolve_paged_kernel('auto', 'float32', 'float32'))\n"
            "print(any('unavailable' in str(x.message) for x in w))\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), JAXGPT_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "auto", "True"]
