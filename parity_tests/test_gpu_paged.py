"""The CUDA paged-attention kernel (jaxgpt/nn/kernels/gpu_paged.py), run on the CPU in Pallas'
interpret mode: the kernel's own program, interpreted, not a CUDA device.

References the test did not compute itself: the engine's pure-JAX path on the same inputs (each
row's pages gathered, kernels/paged.py ``gather``, then the einsum kernel 'xla'), and transformers'
greedy ``generate`` for the engine run with the kernel (``paged_kernel='pallas'``, interpreted here).
Bounds, with the worst error measured over 3 seeds x the two shapes below: float32 1e-5 (measured
3.6e-7: another summation order); int8 pages in a float32 model 1e-5 (3.6e-7: both dequantise to
float32 first); bfloat16 queries and pages, and int8 pages in a bfloat16 model, two bfloat16 ulps of
the largest output, 2**-6 * max(1, max|ref|) (measured one ulp: 1.6e-2 at max|ref| 3.2, 7.8e-3 at
1.2-1.9; the kernel rounds the probabilities to bfloat16 before the value product as the gathered
bfloat16 einsum does, summing in another order).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from parity_tests.engine.test_engine import _hf_greedy, _run_staggered, llama  # noqa: F401  (the module fixture: HF LLaMA, jaxgpt params)

from jaxgpt.inference.engine import Engine
from jaxgpt.nn.kernels import attend, gpu_paged
from jaxgpt.nn.kernels.paged import Pages, gather, quantize_int8


def _case(seed, b=4, t=1, h=4, h_kv=2, d=16, ps=4, p=6):
    """Pools with a page table of out-of-order pages and holes (entries past a row's length point to
    the scratch page 0 or to another row's pages), ragged positions, a padding row and padded tokens."""
    rng = np.random.default_rng(seed)
    n_pages = b * p + 3
    k_pool, v_pool = (rng.standard_normal((n_pages, h_kv, ps, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, n_pages))[:b * p].reshape(b, p).astype(np.int32)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    length = rng.integers(t, p * ps - 3, b)  # ragged: each row ends somewhere else
    q_pos = (length[:, None] - t + np.arange(t)[None]).astype(np.int32)
    for i in range(b):  # holes: the table past a row's last page is scratch or a stranger's page
        last = q_pos[i].max() // ps
        table[i, last + 1:] = 0 if i % 2 else table[(i + 1) % b, last + 1:]
    q_pos[1] = -1  # a padding row
    q_pos[-1, t // 2 + (t == 1):] = -1  # a padded tail
    return q, k_pool, v_pool, table, q_pos


def _gathered(q, k_pool, v_pool, table, q_pos, ks=None, vs=None):
    keys, values, mask = gather(k_pool, v_pool, table, q_pos, ks, vs, q.dtype)
    return attend(q, keys, values, impl="xla", mask=mask, kv_layout="rows")


def _err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _bf16_bound(ref):
    return 2.0 ** -6 * max(1.0, float(np.max(np.abs(np.asarray(ref, np.float32)))))


@pytest.mark.parametrize("shape", [dict(t=1, h=4, h_kv=2, d=16),  # a GQA decode step (tl.dot shapes on CUDA)
                                   dict(t=5, h=6, h_kv=2, d=8, ps=8, p=3)],  # a prefill chunk, D below 16
                         ids=["decode-gqa", "prefill-gqa"])
def test_kernel_matches_the_gather_path_float32(shape):
    q, k_pool, v_pool, table, q_pos = map(jnp.asarray, _case(0, **shape))
    got = gpu_paged.paged_attention(q, k_pool, v_pool, table, q_pos, interpret=True)
    assert _err(got, _gathered(q, k_pool, v_pool, table, q_pos)) <= 1e-5
    assert not np.any(np.asarray(got)[1])  # the padding row: zeros, as every kernel gives


def test_kernel_matches_the_gather_path_bfloat16_and_int8():
    q, k_pool, v_pool, table, q_pos = map(jnp.asarray, _case(1))
    bf = lambda x: x.astype(jnp.bfloat16)
    got = gpu_paged.paged_attention(bf(q), bf(k_pool), bf(v_pool), table, q_pos, interpret=True)
    assert got.dtype == jnp.bfloat16
    ref = _gathered(bf(q), bf(k_pool), bf(v_pool), table, q_pos)
    assert _err(got, ref) <= _bf16_bound(ref)
    (kq, ks), (vq, vs) = quantize_int8(k_pool), quantize_int8(v_pool)
    ref = _gathered(bf(q), kq, vq, table, q_pos, ks, vs)  # int8 pages in a bfloat16 model
    assert _err(gpu_paged.paged_attention(bf(q), kq, vq, table, q_pos, ks, vs, interpret=True), ref) <= _bf16_bound(ref)
    got = gpu_paged.paged_attention(q, kq, vq, table, q_pos, ks, vs, interpret=True)
    assert _err(got, _gathered(q, kq, vq, table, q_pos, ks, vs)) <= 1e-5
    # attend's 'pages' layout with the kernel forced: the same call
    forced = attend(q, kq, vq, kv_layout="pages", pages=Pages(table, q_pos, ks, vs, "pallas"))
    assert _err(forced, got) == 0.0


def test_kernel_refuses_what_triton_cannot_block():
    q, k_pool, v_pool, table, q_pos = map(jnp.asarray, _case(2, d=12))
    with pytest.raises(ValueError, match="head_dim 12 and page_size 4 must be"):
        gpu_paged.paged_attention(q, k_pool, v_pool, table, q_pos, interpret=True)
    with pytest.raises(ValueError, match="int8 pools need their scales"):
        gpu_paged.paged_attention(q[..., :8], k_pool[..., :8].astype(jnp.int8), v_pool[..., :8].astype(jnp.int8),
                                  table, q_pos, interpret=True)


@pytest.mark.slow
def test_engine_with_the_interpreted_kernel_matches_transformers(llama):  # noqa: F811 - the fixture
    """The engine's greedy tokens with paged_kernel='pallas' (the CUDA kernel, interpreted on the CPU)
    equal transformers' greedy generate on 8 ragged requests, some arriving mid-flight."""
    model, config, params = llama
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 96, int(rng.integers(1, 14)))] for _ in range(8)]
    news = [int(rng.integers(2, 9)) for _ in range(8)]
    eng = Engine(config, params, max_seqs=8, page_size=8, num_pages=24, max_tokens_per_step=64,
                 paged_kernel="pallas", head_kernel="xla")
    assert eng.paged_kernel == "pallas"
    got = _run_staggered(eng, prompts, news)
    assert got == [_hf_greedy(model, p, n) for p, n in zip(prompts, news)]

