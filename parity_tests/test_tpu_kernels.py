"""The Pallas TPU kernels jaxgpt runs in a program lowered for a TPU, run here on the CPU in TPU
interpret mode (``pltpu.force_tpu_interpret_mode``) and compared with the 'xla' path on the same
inputs: flash attention (kernels/tpu_flash.py), paged attention over the engine's pools (JAX's
decode kernel, kernels/tpu_paged.py, and our ragged kernel, kernels/tpu_ragged.py) and megablox's
grouped matmul (kernels/tpu_gmm.py).

A CPU program never holds these kernels (policy.on_tpu keeps them for TPU programs), so each test
makes ``policy.on_tpu`` pick the kernel branch and calls the public entry (``kernels.attend``,
``moe.experts_grouped``): the wiring (causal flag, scale, segment ids, grouped heads) is checked
with the kernel. That the TPU program holds them is test_lowering.py's. Tolerances: float32 1e-5
(forward and gradients); bfloat16 against the float32 reference, the bound measured (docs/performance.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.config.mesh import AXES, BATCH_AXES
from test_engine import _hf_greedy, _run_staggered, llama  # noqa: F401  (the module fixture: HF LLaMA, jaxgpt params)

from jaxgpt.nn import moe
from jaxgpt.inference.engine import Engine
from jaxgpt.nn.kernels import attend, masks, paged, policy, tpu_flash, tpu_gmm, tpu_paged, tpu_ragged, xla

pytestmark = pytest.mark.cpu_only  # TPU interpret mode and the lowering canary are checked on the CPU backend

B, T, D = 2, tpu_flash.BLOCK, 16
BF16_TOL = 3e-2  # measured 7.8e-3 (flash) and 1.6e-2 (gmm) from the float32 reference, unit-scale inputs


@pytest.fixture
def on_tpu(monkeypatch):
    """The policy's choices as in a program lowered for a TPU (on_tpu and by_platform: the TPU kernel,
    on_cpu: the portable path); the TPU kernels run in TPU interpret mode."""
    monkeypatch.setattr(policy, "on_tpu", lambda kernel, portable, *args: kernel(*args))
    monkeypatch.setattr(policy, "on_cpu", lambda kernel, portable, *args: portable(*args))
    monkeypatch.setattr(policy, "by_platform", lambda *args, default, **kernels: kernels.get("tpu", default)(*args))
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        yield


def _qkv(h, h_kv, dtype=jnp.float32, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, h, D))
    k, v = jax.random.normal(kk, (B, T, h_kv, D)), jax.random.normal(kv, (B, T, h_kv, D))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), jax.random.normal(kc, (B, T, h, D))


def _segments():
    """(B, T) packed documents: row 0 three of them (lengths 50, 1, 77), row 1 one."""
    row0 = np.repeat([0, 1, 2], [50, 1, T - 51])
    return jnp.asarray(np.stack([row0, np.zeros(T, int)]), jnp.int32)


CASES = {  # name: (query heads, key/value heads, causal, segment ids)
    "causal-mqa": (2, 1, True, False),
    "full-mha": (2, 2, False, False),
    "causal-gqa-segments": (4, 2, True, True),  # two K/V heads of two query heads each: the head order shows
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "causal-mqa" else c
                                  for c in sorted(CASES)])  # 'causal-gqa-segments' covers it in the fast tier
def test_flash_attention_matches_xla_float32(case, on_tpu):
    h, h_kv, causal, segs = CASES[case]
    q, k, v, ct = _qkv(h, h_kv)
    seg = _segments() if segs else None
    assert tpu_flash.unsupported(q, k, mask=None, is_causal=causal, q_offset=0, kv_layout="tokens") is None

    def run(impl):  # the output and the gradients of <out, ct> (every output element weighs in)
        def f(q, k, v, ct):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, impl=impl, is_causal=causal, segment_ids=seg,
                                                      scale=0.3), q, k, v)
            return out, vjp(ct)
        return jax.jit(f)(q, k, v, ct)

    (out, grads), (ref_out, ref) = run("auto"), run("xla")
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=0)
    for name, g, r in zip("qkv", grads, ref):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=f"d{name}")


@pytest.mark.slow
def test_flash_attention_bfloat16_within_bound(on_tpu):
    q, k, v, _ = _qkv(4, 2, jnp.bfloat16, seed=1)
    seg = _segments()
    got = jax.jit(lambda q, k, v: attend(q, k, v, is_causal=True, segment_ids=seg))(q, k, v).astype(jnp.float32)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want = xla.scaled_dot_product_attention(*f32, is_causal=True, mask=(seg[:, :, None] == seg[:, None, :])[:, None])
    err = float(jnp.abs(got - want).max())
    print(f"\nflash bf16 max error from float32: {err:.2e}")
    assert err < BF16_TOL


def test_flash_rule_sends_other_calls_to_the_portable_path():
    """tpu_flash.unsupported: T not a multiple of the block, a mask, a KV cache offset, weights."""
    q, k, _, _ = _qkv(4, 2)
    ok = dict(mask=None, is_causal=True, q_offset=0, kv_layout="tokens")
    assert "multiple of 128" in tpu_flash.unsupported(q[:, :64], k[:, :64], **ok)
    assert "no mask" in tpu_flash.unsupported(q, k, **{**ok, "mask": jnp.ones((T, T), bool)})
    assert "KV cache" in tpu_flash.unsupported(q, k, **{**ok, "q_offset": 3})
    assert "weights" in tpu_flash.unsupported(q, k, **ok, return_weights=True)


@pytest.mark.parametrize("split", ["data", "tensor"])
def test_flash_runs_per_device_under_a_mesh(split, monkeypatch):
    """Under a mesh (a sharded train step's ambient mesh) the kernel runs in a shard_map on each
    device's rows ('data') or heads ('tensor'): the TPU program holds it inside a manual computation.
    The numbers are checked with the kernel swapped for the 'xla' path (TPU interpret mode does not
    run inside a shard_map on the CPU): this checks the split and the reassembly, not the kernel."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape([2 if a == split else 1 for a in AXES]), AXES)
    q, k, v, _ = _qkv(4, 2)
    seg = _segments()

    def f(q, k, v, seg):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return tpu_flash.flash_attention(q, k, v, is_causal=True, scale=0.3, segment_ids=seg)

    text = jax.jit(f).trace(q, k, v, seg).lower(lowering_platforms=("tpu",)).as_text()
    assert "sdy.manual_computation" in text and "@tpu_custom_call" in text
    shapes = []

    def fake(q, k, v, s, *, is_causal, scale):  # the 'xla' path on one device's block
        shapes.append((q.shape, k.shape, s.shape))
        return xla.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                mask=(s[:, :, None] == s[:, None, :])[:, None])

    monkeypatch.setattr(tpu_flash, "_flash", fake)
    spec = P(BATCH_AXES) if split == "data" else P(None, None, "tensor")
    got = jax.jit(f)(*(jax.device_put(a, NamedSharding(mesh, spec)) for a in (q, k, v)), seg)
    want = xla.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                            mask=(seg[:, :, None] == seg[:, None, :])[:, None])
    b, h, h_kv = (B // 2, 4, 2) if split == "data" else (B, 2, 1)
    assert shapes == [((b, T, h, D), (b, T, h_kv, D), (b, T))]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def _experts(dtype):
    n, d, f, e, k = 16, 32, 64, 4, 2  # 32 (token, expert) rows: row tile 32
    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (n, d))
    gate, up = (jax.random.normal(kk, (e, d, f)) * d ** -0.5 for kk in ks[1:3])
    down = jax.random.normal(ks[3], (e, f, d)) * f ** -0.5
    logits = jax.random.normal(ks[4], (n, e)).at[:, 3].set(-9.0)  # expert 3 gets no token: an empty group
    _, weights, idx = moe.route(logits, k, True)
    return [a.astype(dtype) for a in (x, gate, up, down)], weights, idx


def test_gmm_moe_matches_ragged_dot(on_tpu):
    (x, gate, up, down), weights, idx = _experts(jnp.float32)
    assert tpu_gmm.unsupported(jnp.repeat(x, idx.shape[1], axis=0), gate) is None  # the (N k, d) rows

    def loss(x, gate, up, down):
        return jnp.sum(moe.experts_grouped(x, gate, up, down, weights, idx) ** 2)

    got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gate, up, down)
    with pytest.MonkeyPatch.context() as mp:  # the portable grouped path: jax.lax.ragged_dot
        mp.setattr(policy, "on_tpu", lambda kernel, portable, *args: portable(*args))
        want, ref = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, r in zip(("x", "gate", "up", "down"), grads, ref):
        np.testing.assert_allclose(g, r, atol=1e-5 * float(jnp.abs(r).max()), rtol=0, err_msg=f"d{name}")


@pytest.mark.slow
def test_gmm_moe_bfloat16_within_bound(on_tpu):
    (x, gate, up, down), weights, idx = _experts(jnp.float32)
    run = jax.jit(lambda *a: moe.experts_grouped(*a, weights, idx).astype(jnp.float32))
    y16, y32 = run(*_experts(jnp.bfloat16)[0]), run(x, gate, up, down)
    err = float(jnp.abs(y16 - y32).max())
    print(f"\ngmm bf16 max error from float32: {err:.2e} (outputs up to {float(jnp.abs(y32).max()):.2f})")
    assert err < BF16_TOL * float(jnp.abs(y32).max())


PAGE, DP = 8, 128  # page size; the paged kernel's head_dim is a multiple of 128
# Row 0: a 4-token prefill chunk at positions 18..21 over pages 5, 2, 9 (out of order, crossing a page
# boundary), its last slot unused (scratch page 0); row 1: a decode step at position 3 on page 7, one
# query and three padding; row 2: all padding. Pages 1, 3, 4, 6, 8, 10, 11 belong to no row (holes).
PAGE_TABLE = [[5, 2, 9, 0], [7, 0, 0, 0], [0, 0, 0, 0]]
Q_POS = [[18, 19, 20, 21], [3, -1, -1, -1], [-1, -1, -1, -1]]


def _paged_inputs(q_dtype):
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    pools = [jax.random.normal(kk_, (12, 2, PAGE, DP)).astype(jnp.bfloat16) for kk_ in (kk, kv)]  # H_kv 2
    q = jax.random.normal(kq, (3, 4, 4, DP)).astype(q_dtype)  # (B, T, H 4, D): two query heads a K/V head
    return q, *pools, jnp.asarray(PAGE_TABLE, jnp.int32), jnp.asarray(Q_POS, jnp.int32)


@pytest.mark.parametrize("t", [4, 1], ids=["mixed-ragged", "decode-jax"])
def test_paged_attention_reads_the_pools_in_place(t, on_tpu):
    """kv_layout 'pages' through attend on bfloat16 pools, float32 queries, against the 'xla' path
    over the gathered pages (the same bfloat16 values, float32 arithmetic: 1e-5). A 4-token step runs
    our ragged kernel (tpu_ragged.py), a decode step (T == 1) JAX's decode kernel (tpu_paged.py)."""
    q, k_pool, v_pool, table, q_pos = _paged_inputs(jnp.float32)
    q, q_pos = q[:, :t], q_pos[:, :t]
    assert tpu_paged.unsupported(q, k_pool) is None and tpu_ragged.unsupported(q, k_pool) is None
    run = jax.jit(lambda q, k, v, t, p: attend(q, k, v, kv_layout="pages", pages=(t, p), scale=0.1))
    got = run(q, k_pool, v_pool, table, q_pos)
    k, v, mask = paged.gather(k_pool.astype(jnp.float32), v_pool.astype(jnp.float32), table, q_pos)
    want = xla.scaled_dot_product_attention(q, k, v, mask=mask, kv_layout="rows", scale=0.1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert not np.asarray(got[2]).any() and not np.asarray(got[1, 1:]).any()  # padding: zeros


@pytest.mark.slow
def test_paged_attention_bfloat16_within_bound(on_tpu):
    """JAX's decode kernel (a decode step, T == 1) on bfloat16 queries; ours: test_ragged_kernel_bfloat16_within_bound."""
    q, k_pool, v_pool, table, q_pos = _paged_inputs(jnp.float32)
    q, q_pos = q[:, :1], q_pos[:, :1]
    k, v, mask = paged.gather(k_pool.astype(jnp.float32), v_pool.astype(jnp.float32), table, q_pos)
    want = xla.scaled_dot_product_attention(q, k, v, mask=mask, kv_layout="rows", scale=0.1)
    got16 = jax.jit(lambda q: attend(q, k_pool, v_pool, kv_layout="pages", pages=(table, q_pos), scale=0.1))(
        q.astype(jnp.bfloat16)).astype(jnp.float32)
    err = float(jnp.abs(got16 - want).max())
    print(f"\ndecode kernel bf16 max error from float32: {err:.2e}")
    assert err < BF16_TOL


def _ragged_case(seed, b=3, t=10, h=6, h_kv=2, d=16, ps=4, p=5, dtype=jnp.float32):
    """float32 pools with a page table of out-of-order pages and holes (entries past a row's last page
    point to the scratch page 0 or to another row's pages), ragged positions (a prefill chunk, a chunk
    mid-sequence), a padding row and a padded tail; GQA of G = h / h_kv (3: rows are no multiple of 8)."""
    rng = np.random.default_rng(seed)
    n = b * p + 3
    k_pool, v_pool = (rng.standard_normal((n, h_kv, ps, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, n))[:b * p].reshape(b, p).astype(np.int32)
    length = np.array([t, p * ps - 2, 9])[:b]  # row 0 from position 0, row 1 near the end of its pages
    q_pos = (length[:, None] - t + np.arange(t)[None]).astype(np.int32)
    for i in range(b):
        table[i, q_pos[i].max() // ps + 1:] = 0 if i % 2 else table[(i + 1) % b, q_pos[i].max() // ps + 1:]
    q_pos[2] = -1  # a padding row
    q_pos[1, t - 2:] = -1  # a padded tail
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table), jnp.asarray(q_pos)


def _gathered(q, k_pool, v_pool, table, q_pos, ks=None, vs=None, window=None, scale=None):
    """The reference: each row's pages gathered (paged.gather), then the 'xla' kernel; padding rows zeros."""
    k, v, mask = paged.gather(k_pool, v_pool, table, q_pos, ks, vs, q.dtype, window=window)
    out = xla.scaled_dot_product_attention(q, k, v, mask=mask, kv_layout="rows", scale=scale)
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0)


def test_ragged_kernel_matches_the_gather_path_float32(on_tpu):
    """Our ragged kernel against the gather path, 1e-5: through attend's 'pages' layout (the dispatch's
    TPU branch for T > 1) with a sliding window of 5, and called with query blocks of 16 rows and the
    traced window of a scanned global layer (masks.NO_WINDOW): row 0's first block ends at position 5
    (page 1), its second at 9 (page 2), so each block needs its own span of pages."""
    q, k_pool, v_pool, table, q_pos = _ragged_case(4)
    assert tpu_ragged.unsupported(q, k_pool) is None
    got = jax.jit(lambda q: attend(q, k_pool, v_pool, kv_layout="pages", pages=paged.Pages(table, q_pos),
                                   scale=0.3, window=5))(q)
    np.testing.assert_allclose(got, _gathered(q, k_pool, v_pool, table, q_pos, window=5, scale=0.3), atol=1e-5, rtol=0)
    assert not np.asarray(got[2]).any() and not np.asarray(got[1, -2:]).any()  # padding: zeros
    blocks = jax.jit(lambda w: tpu_ragged.paged_attention(q, k_pool, v_pool, table, q_pos, scale=0.3, window=w,
                                                          block_m=16))(jnp.int32(masks.NO_WINDOW))
    np.testing.assert_allclose(blocks, _gathered(q, k_pool, v_pool, table, q_pos, scale=0.3), atol=1e-5, rtol=0)


def test_ragged_kernel_int8_pages(on_tpu):
    """int8 pools with their per-token scales, dequantised in the kernel: float32 queries 1e-5 from
    the gather path, which dequantises the same way."""
    q, k_pool, v_pool, table, q_pos = _ragged_case(5, t=3)
    (kq, ks), (vq, vs) = paged.quantize_int8(k_pool), paged.quantize_int8(v_pool)
    got = jax.jit(lambda q: attend(q, kq, vq, kv_layout="pages", pages=paged.Pages(table, q_pos, ks, vs)))(q)
    np.testing.assert_allclose(got, _gathered(q, kq, vq, table, q_pos, ks, vs), atol=1e-5, rtol=0)


def test_ragged_kernel_bfloat16_within_bound(on_tpu):
    """bfloat16 queries and pools against the float32 reference on the same (bfloat16-rounded) values:
    the kernel rounds the probabilities to bfloat16 before the value product, as the 'xla' path in
    bfloat16 does. Bound: 2**-7 of the largest output, one bfloat16 ulp at 1-2 (over seeds 6-29 measured
    at most 9.3e-3, 0.48 of the bound at worst, never above the 'xla' path's own bfloat16 error)."""
    q, k_pool, v_pool, table, q_pos = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a
                                       for a in _ragged_case(6))
    got = jax.jit(lambda q: attend(q, k_pool, v_pool, kv_layout="pages", pages=paged.Pages(table, q_pos)))(q)
    assert got.dtype == jnp.bfloat16
    f32 = [a.astype(jnp.float32) for a in (q, k_pool, v_pool)]
    want = _gathered(*f32, table, q_pos)
    same = _gathered(q, k_pool, v_pool, table, q_pos).astype(jnp.float32)  # the gather path in bfloat16
    err, xla_err = (float(jnp.abs(a.astype(jnp.float32) - want).max()) for a in (got, same))
    print(f"\nragged bf16 max error from float32: {err:.2e} (the xla path in bf16: {xla_err:.2e}; "
          f"outputs up to {float(jnp.abs(want).max()):.2f})")
    assert err <= 2.0 ** -7 * max(1.0, float(jnp.abs(want).max()))


def test_ragged_kernel_refusals():
    """What the kernel refuses, each in one line (the dispatch gathers instead)."""
    q, k_pool, *_ = _ragged_case(7, t=1)
    assert "pools (got float16)" in tpu_ragged.unsupported(q, k_pool.astype(jnp.float16))
    assert "(got int32 queries)" in tpu_ragged.unsupported(q.astype(jnp.int32), k_pool)
    assert "multiple of key/value heads (4)" in tpu_ragged.unsupported(q, jnp.zeros((3, 4, 4, 16)))
    with pytest.raises(ValueError, match="int8 pools need their scales"):
        tpu_ragged.paged_attention(q, k_pool.astype(jnp.int8), k_pool.astype(jnp.int8), *_ragged_case(7, t=1)[3:])


@pytest.mark.slow
def test_engine_with_the_ragged_kernel_matches_transformers(llama, on_tpu):  # noqa: F811 - the fixture
    """The engine (paged_kernel 'auto', float32 pools: every step, prefill chunks and decode, runs our
    ragged kernel in TPU interpret mode) gives transformers' greedy tokens on 8 ragged requests, some
    arriving mid-flight."""
    model, config, params = llama
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 96, int(rng.integers(1, 14)))] for _ in range(8)]
    news = [int(rng.integers(2, 9)) for _ in range(8)]
    eng = Engine(config, params, max_seqs=8, page_size=8, num_pages=24, max_tokens_per_step=64, head_kernel="xla")
    got = _run_staggered(eng, prompts, news)
    assert got == [_hf_greedy(model, p, n) for p, n in zip(prompts, news)]


def test_jax_ragged_paged_attention_still_fails_in_interpret_mode():
    """Why the engine's mixed steps run our kernel (kernels/tpu_ragged.py) and not JAX's
    ragged_paged_attention: JAX's lowers for a TPU named by an abstract mesh (test_lowering.py) but
    fails in TPU interpret mode here, so nothing on this host could prove it. When this fails (JAX's
    kernel interprets), prove it against the gather path and consider switching (its pool layout
    (pages, page_size, 2 H_kv, D), K and V interleaved, differs from the engine's)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    q, kv = jnp.ones((16, 4, 128)), jnp.ones((12, 8, 4, 128))  # 4 query heads, 2 K/V heads interleaved
    lens, table = jnp.asarray([5, 3, 0, 0], jnp.int32), jnp.arange(16, dtype=jnp.int32).reshape(4, 4) % 12
    cu_q, seqs = jnp.asarray([0, 4, 5, 5, 5], jnp.int32), jnp.asarray([2], jnp.int32)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()), pytest.raises(Exception, match="ReshapeTransform"):
        ragged_paged_attention(q, kv, lens, table, cu_q, seqs, num_kv_pages_per_block=2,
                               num_queries_per_block=8).block_until_ready()
