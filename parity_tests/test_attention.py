"""Attention: the pure SDPA core vs torch's F.scaled_dot_product_attention and torch_ref, the
Attention module vs torch_ref and nn.MultiheadAttention, the seed's checks (sqrt(d_k) saturation,
4 d^2 parameters) and KV-cached decoding == full causal attention, step by step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, assert_self_consistent, check_module, load_into, random_params
from jaxgpt.config import RopeScaling
from jaxgpt.nn.attention import Attention, KVCache, causal_mask, scaled_dot_product_attention as sdpa
from test_positions import SCALINGS
from torch_ref.nn import attention as tattn

HEADS = [(4, 4), (4, 2), (4, 1), (6, 3)]  # (n_head, n_kv_head): MHA, GQA, MQA, GQA


def _qkv(rng, b, tq, tk, h, h_kv, d):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return f(b, tq, h, d), f(b, tk, h_kv, d), f(b, tk, h_kv, d)


def _torch_bhtd(*xs):
    return [torch.from_numpy(x).transpose(1, 2) for x in xs]


@pytest.mark.parametrize("h,h_kv", HEADS)
@pytest.mark.parametrize("t", [1, 8, 13])
def test_sdpa_causal_matches_torch_builtin(h, h_kv, t, rng):
    q, k, v = _qkv(rng, 2, t, t, h, h_kv, 16)
    ref = F.scaled_dot_product_attention(*_torch_bhtd(q, k, v), is_causal=True, enable_gqa=h != h_kv)
    assert_close(sdpa(q, k, v, is_causal=True), ref.transpose(1, 2), "sdpa vs F.sdpa")


@pytest.mark.parametrize("h,h_kv", HEADS)
def test_sdpa_bool_mask_matches_torch_builtin(h, h_kv, rng):
    q, k, v = _qkv(rng, 2, 5, 7, h, h_kv, 8)
    mask = rng.random((2, 1, 5, 7)) > 0.4
    mask[0, 0, 2] = False  # a fully masked row: zeros on both sides
    ref = F.scaled_dot_product_attention(*_torch_bhtd(q, k, v), attn_mask=torch.from_numpy(mask), enable_gqa=h != h_kv)
    out = sdpa(q, k, v, mask=mask)
    assert_close(out, ref.transpose(1, 2), "sdpa vs F.sdpa")
    assert np.all(np.asarray(out)[0, 2] == 0.0)


@pytest.mark.parametrize("h,h_kv", HEADS)
def test_sdpa_per_head_mask_and_weights_match_torch_ref(h, h_kv, rng):
    q, k, v = _qkv(rng, 2, 6, 6, h, h_kv, 8)
    mask = rng.random((2, h, 6, 6)) > 0.3
    out, w = sdpa(q, k, v, mask=mask, is_causal=True, return_weights=True)
    tout, tw = tattn.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), mask=torch.from_numpy(mask),
                                                  is_causal=True, return_weights=True)
    assert_close(out, tout, "sdpa vs torch_ref")
    assert_close(w, tw, "sdpa weights vs torch_ref")
    fast = tattn.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), mask=torch.from_numpy(mask), is_causal=True)
    assert_self_consistent(fast, tout, "torch_ref sdpa: fused vs explicit path")
    w = np.asarray(w)
    assert np.all(w[:, :, np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]] == 0)  # causal
    rows = w.sum(-1)
    assert np.allclose(rows[rows > 0], 1, atol=1e-6)


def test_sdpa_query_offset_equals_rows_of_full_causal(rng):
    q, k, v = _qkv(rng, 1, 10, 10, 4, 2, 8)
    full = np.asarray(sdpa(q, k, v, is_causal=True))
    part = sdpa(q[:, 6:], k, v, is_causal=True, q_offset=6)
    assert_self_consistent(part, full[:, 6:], "sdpa: query offset vs rows of full causal")
    assert causal_mask(2, 5, 3).tolist() == [[True] * 4 + [False], [True] * 5]


def test_sdpa_kv_layouts(rng):
    """Keys/values as projected (B, Tk, H_kv, D), as a cache layer (B, H_kv, Tk, D), and as the decode
    cache's rows (B * H_kv, Tk, D): the same attention."""
    q, k, v = _qkv(rng, 2, 3, 9, 6, 2, 8)
    mask = rng.random((2, 1, 1, 9)) > 0.3
    a = sdpa(q, k, v, mask=mask, is_causal=True, q_offset=6)
    heads = lambda x: x.transpose(0, 2, 1, 3)
    b = sdpa(q, heads(k), heads(v), mask=mask, is_causal=True, q_offset=6, kv_layout="heads")
    assert_self_consistent(a, b, "sdpa: 'heads' vs 'tokens' layout")
    rows = lambda x: heads(x).reshape(2 * 2, 9, 8)
    c = sdpa(q, rows(k), rows(v), mask=mask, is_causal=True, q_offset=6, kv_layout="rows")
    assert_self_consistent(a, c, "sdpa: 'rows' vs 'tokens' layout")
    with pytest.raises(ValueError, match=r"kv_layout='bhtd' is not one of \('tokens', 'heads', 'rows'\)"):
        sdpa(q, k, v, kv_layout="bhtd")


def test_sdpa_rejects_bad_head_split(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 4, 3, 8)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        sdpa(q, k, v)


def test_sqrt_dk_scaling_prevents_saturation():
    """Seed 000: at d_k = 512, unscaled scores make softmax nearly one-hot; scaled ones do not."""
    rng = np.random.default_rng(42)
    q = rng.standard_normal((1, 8, 1, 512)).astype(np.float32)
    k = rng.standard_normal((1, 8, 1, 512)).astype(np.float32)
    v = np.zeros_like(k)
    _, w_raw = sdpa(q, k, v, scale=1.0, return_weights=True)
    _, w = sdpa(q, k, v, return_weights=True)
    assert float(jnp.max(w_raw)) > 0.99  # saturated
    assert float(jnp.mean(jnp.max(w_raw, -1))) > 0.9
    assert float(jnp.mean(jnp.max(w, -1))) < 0.7  # scaled: spread out


def _attention_pair(d, h, h_kv, **kw):
    return (Attention(d_model=d, n_head=h, n_kv_head=h_kv, **kw),
            tattn.Attention(d_model=d, n_head=h, n_kv_head=h_kv, **kw))


@pytest.mark.parametrize("h,h_kv", HEADS)
@pytest.mark.parametrize("rope,bias", [(False, False), (True, False), (True, True)])
def test_self_attention_matches_torch_ref(h, h_kv, rope, bias, rng):
    d = 8 * h
    x = rng.standard_normal((2, 7, d)).astype(np.float32)
    mask = rng.random((2, 1, 1, 7)) > 0.2  # padding-style key mask, combined with causal
    mask[:, ..., 0] = True
    ja, ta = _attention_pair(d, h, h_kv, rope=rope, qkv_bias=bias, o_bias=bias, rope_layout="interleaved" if bias else "half")
    kw = dict(mask=mask, is_causal=True)
    check_module("Attention", ja, ta.eval(), [x], jax_kwargs=kw,
                 torch_kwargs=dict(mask=torch.from_numpy(mask), is_causal=True), select=lambda o: o[0])


@pytest.mark.parametrize("head_dim", [6, 16])
def test_head_dim_apart_from_d_model_matches_torch_ref(head_dim, rng):
    # Gemma and Qwen3 heads: n_head * head_dim != d_model, so q_proj and o_proj are not square.
    x = rng.standard_normal((2, 7, 20)).astype(np.float32)
    ja, ta = _attention_pair(20, 4, 2, rope=True, head_dim=head_dim)
    check_module("Attention (head_dim)", ja, ta.eval(), [x], jax_kwargs=dict(is_causal=True),
                 torch_kwargs=dict(is_causal=True), select=lambda o: o[0])
    assert ta.q_proj.weight.shape == (4 * head_dim, 20) and ta.o_proj.weight.shape == (20, 4 * head_dim)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scaling_matches_torch_ref(name, rng):
    """Each RoPE scaling threaded through Attention: forward and gradients vs torch_ref at positions 8..31,
    past the original context of 16 (the frequencies vs HF: test_positions.py, test_rope_scaling.py)."""
    x = rng.standard_normal((2, 24, 32)).astype(np.float32)
    scaling = RopeScaling.from_hf(SCALINGS[name], 32)
    ja, ta = _attention_pair(32, 2, 1, rope=True, rope_scaling=scaling)
    pos = np.arange(8, 32)
    check_module(f"Attention (rope {name})", ja, ta.eval(), [x], jax_kwargs=dict(is_causal=True, positions=pos),
                 torch_kwargs=dict(is_causal=True, positions=torch.from_numpy(pos)), select=lambda o: o[0])


@pytest.mark.parametrize("h,h_kv", HEADS[:3])
def test_cross_attention_matches_torch_ref(h, h_kv, rng):
    d = 8 * h
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    ctx = rng.standard_normal((2, 9, d)).astype(np.float32)
    mask = np.ones((2, 1, 1, 9), bool)
    mask[1, ..., 6:] = False  # second source sequence is padded
    ja, ta = _attention_pair(d, h, h_kv, qkv_bias=True, o_bias=True)
    check_module("Attention (cross)", ja, ta, [x, ctx], jax_kwargs=dict(mask=mask),
                 torch_kwargs=dict(mask=torch.from_numpy(mask)), select=lambda o: o[0])


def test_attention_matches_nn_multiheadattention(rng):
    d, h = 32, 4
    x = rng.standard_normal((3, 6, d)).astype(np.float32)
    ja = Attention(d_model=d, n_head=h, qkv_bias=True, o_bias=True)
    p = random_params(ja, x)
    mha = torch.nn.MultiheadAttention(d, h, batch_first=True)
    with torch.no_grad():  # packed in-projection: rows [q; k; v], each (out, in)
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([np.asarray(p[n]["kernel"]).T for n in ("q_proj", "k_proj", "v_proj")])))
        mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([np.asarray(p[n]["bias"]) for n in ("q_proj", "k_proj", "v_proj")])))
        mha.out_proj.weight.copy_(torch.from_numpy(np.asarray(p["o_proj"]["kernel"]).T.copy()))
        mha.out_proj.bias.copy_(torch.tensor(np.asarray(p["o_proj"]["bias"])))
    xt = torch.from_numpy(x)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)  # torch: True = *masked*
    ref, ref_w = mha(xt, xt, xt, attn_mask=causal, need_weights=True, average_attn_weights=False)
    y, _, w = ja.apply({"params": p}, x, is_causal=True, return_weights=True)
    assert_close(y, ref, "Attention vs nn.MultiheadAttention")
    assert_close(w, ref_w, "Attention vs nn.MultiheadAttention")


def test_mha_parameter_count_is_4d2():
    d = 64
    p = Attention(d_model=d, n_head=4).init(jax.random.PRNGKey(0), jnp.zeros((1, 2, d)))["params"]
    assert sum(x.size for x in jax.tree.leaves(p)) == 4 * d * d
    assert sum(x.numel() for x in tattn.Attention(d, 4).parameters()) == 4 * d * d
    gqa = Attention(d_model=d, n_head=4, n_kv_head=1).init(jax.random.PRNGKey(0), jnp.zeros((1, 2, d)))["params"]
    assert sum(x.size for x in jax.tree.leaves(gqa)) == 2 * d * d + 2 * d * (d // 4)


@pytest.mark.parametrize("h,h_kv,rope", [(4, 4, False), (4, 2, True), (4, 1, True)])
def test_kv_cache_decoding_equals_full_causal(h, h_kv, rope, rng):
    """Seed 000/003: prefill then one token at a time through the cache == one causal pass."""
    d, t, prompt, cap = 8 * h, 10, 4, 16
    x = rng.standard_normal((2, t, d)).astype(np.float32)
    ja, ta = _attention_pair(d, h, h_kv, rope=rope, qkv_bias=True)
    p = random_params(ja, x)
    load_into(ta, p)
    full = np.asarray(ja.apply({"params": p}, x, is_causal=True)[0])
    tfull = ta(torch.from_numpy(x), is_causal=True)[0]
    assert_close(full, tfull, "Attention")

    step = jax.jit(lambda c, xs: ja.apply({"params": p}, xs, is_causal=True, cache=c)[:2])
    cache = KVCache.init(2, h_kv, cap, d // h)
    tcache = tattn.KVCache.init(2, h_kv, cap, d // h)
    y, cache = step(cache, x[:, :prompt])
    ty, tcache, _ = ta(torch.from_numpy(x[:, :prompt]), is_causal=True, cache=tcache)
    outs, touts = [y], [ty]
    for i in range(prompt, t):
        y, cache = step(cache, x[:, i:i + 1])  # same shapes every step: compiled once
        ty, tcache, _ = ta(torch.from_numpy(x[:, i:i + 1]), is_causal=True, cache=tcache)
        outs.append(y)
        touts.append(ty)
    assert int(cache.index) == t and tcache.index == t
    assert step._cache_size() == 2  # one trace for the prefill shape, one for the decode shape
    assert_self_consistent(np.concatenate(outs, 1), full, "Attention: KV cache vs full causal")
    assert_self_consistent(torch.cat(touts, 1), tfull, "torch_ref Attention: KV cache vs full causal")
    assert_close(cache.k, tcache.k, "Attention KV cache contents")


@pytest.mark.parametrize("impl", ["xla", "jax", "blocked"])
def test_kv_cache_layouts_and_kernels_equal_full_causal(impl, rng):
    """A one-layer cache in layout 'heads' and in 'rows' (the decode layout), prefill then two
    single tokens, through every kernel: equal to one full causal pass (rows are read by the
    non-einsum kernels as (B, H_kv, S, D))."""
    h, h_kv, d, t = 4, 2, 16, 7
    x = rng.standard_normal((2, t, d)).astype(np.float32)
    ja = Attention(d_model=d, n_head=h, n_kv_head=h_kv, rope=True, attention_impl=impl, attention_block=3)
    p = random_params(ja, x)
    full = Attention(d_model=d, n_head=h, n_kv_head=h_kv, rope=True).apply({"params": p}, x, is_causal=True)[0]
    caches = {}
    for layout in ("heads", "rows"):
        cache, outs = KVCache.init(2, h_kv, 12, d // h, layout=layout), []
        for lo, hi in [(0, 5), (5, 6), (6, 7)]:
            y, cache, _ = ja.apply({"params": p}, x[:, lo:hi], is_causal=True, cache=cache)
            outs.append(y)
        assert cache.layout == layout and int(cache.index) == t
        assert_self_consistent(np.concatenate(outs, 1), full, f"Attention[{impl}]: {layout!r} KV cache vs full causal")
        caches[layout] = cache
    np.testing.assert_array_equal(caches["rows"].k.reshape(caches["heads"].k.shape), caches["heads"].k)


def test_kv_cache_layout_is_declared_not_inferred():
    """The layout is the cache's field: a 'heads' cache holding 'rows'-shaped buffers is an error
    naming both shapes (no silent switch on ndim), a 'stacked' cache is not one layer's, and an
    unknown layout is refused when the cache is built."""
    ja = Attention(d_model=8, n_head=2)
    p = ja.init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 8)))["params"]
    rows = KVCache.init(1, 2, 4, 4, layout="rows")
    with pytest.raises(ValueError, match=r"a 'heads' KV cache of shape \(2, 4, 4\) does not fit batch 1 x 2 key/value "
                                         r"heads of size 4: it needs \(1, 2, 4, 4\)"):
        ja.apply({"params": p}, jnp.zeros((1, 3, 8)), is_causal=True, cache=KVCache(rows.k, rows.v, rows.index))
    stacked = KVCache(jnp.zeros((3, 1, 2, 4, 4)), jnp.zeros((3, 1, 2, 4, 4)), jnp.zeros(3, jnp.int32), "stacked")
    with pytest.raises(ValueError, match="a 'stacked' KV cache holds every layer: pass it to DecoderLM"):
        ja.apply({"params": p}, jnp.zeros((1, 3, 8)), is_causal=True, cache=stacked.replace(index=jnp.int32(0)))
    with pytest.raises(ValueError, match=r"KVCache layout='bhsd' is not one of \('heads', 'rows', 'stacked'\)"):
        KVCache(rows.k, rows.v, rows.index, "bhsd")
    with pytest.raises(ValueError, match="KVCache.init makes one layer's cache"):
        KVCache.init(1, 2, 4, 4, layout="stacked")


def test_torch_kv_cache_overflow_is_an_error(rng):
    ta = tattn.Attention(8, 2)
    cache = tattn.KVCache.init(1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"KV cache overflow: 0 cached \+ 5 new > capacity 4"):
        ta(torch.zeros(1, 5, 8), is_causal=True, cache=cache)


def test_jax_kv_cache_overflow_is_an_error(rng):
    """The twin of the torch test: dynamic_update_slice would clamp the start and overwrite the
    last slots, so a concrete index is checked first (under jit: checked mode, test_guards.py)."""
    ja = Attention(d_model=8, n_head=2)
    p = ja.init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 8)))["params"]
    with pytest.raises(ValueError, match=r"KV cache overflow: 0 cached \+ 5 new > capacity 4"):
        ja.apply({"params": p}, jnp.zeros((1, 5, 8)), is_causal=True, cache=KVCache.init(1, 2, 4, 4))


def test_attention_dropout_only_in_training(rng):
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    ja = Attention(d_model=16, n_head=2, attn_dropout=0.5)
    p = ja.init(jax.random.PRNGKey(0), x)["params"]
    det = ja.apply({"params": p}, x, is_causal=True)[0]
    assert_self_consistent(det, ja.apply({"params": p}, x, is_causal=True)[0], "Attention: deterministic vs default")
    r = {"dropout": jax.random.PRNGKey(1)}
    a = ja.apply({"params": p}, x, is_causal=True, deterministic=False, rngs=r)[0]
    b = ja.apply({"params": p}, x, is_causal=True, deterministic=False, rngs=r)[0]
    assert np.array_equal(np.asarray(a), np.asarray(b))  # a pure function of the rng
    assert np.abs(np.asarray(a) - np.asarray(det)).max() > 1e-3
    ta = load_into(tattn.Attention(16, 2, attn_dropout=0.5), p)
    assert_close(det, ta.eval()(torch.from_numpy(x), is_causal=True)[0], "Attention")
    assert np.abs(ta.train()(torch.from_numpy(x), is_causal=True)[0].detach().numpy() - np.asarray(det)).max() > 1e-3
