"""Generation (jaxgpt/inference/generate.py): sampled decoding with and without the KV cache under the same
rng, the sampling filters (top-k, top-p, temperature) on their own and against torch_ref's, EOS
handling, the crop-to-context fallback, one compilation per setting, and argument errors.
(Greedy cached == uncached == torch_ref without EOS or cropping is in test_decoder.py.)"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import load_into
from jaxgpt import build
from jaxgpt.inference import generate as gen_module
from jaxgpt.config import ModelConfig
from jaxgpt.inference.generate import generate, sample_logits
from jaxgpt.models import init_params
from torch_ref import build as tbuild
from torch_ref.generate import generate as tgenerate
from torch_ref.generate import sample_logits as tsample_logits

# init_std 0.5: logits spread out (mean entropy ~1.5 nats at temperature 0.8), so sampling is not degenerate.
CFG = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_len=32, pos="rope",
                  init_std=0.5)
PROMPTS = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, 5)).astype(np.int32)
N_NEW = 20
SAMPLED = {"temp": dict(temperature=0.8), "top_k": dict(temperature=0.8, top_k=5),
           "top_p": dict(temperature=0.8, top_p=0.9)}


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0))  # eager init is ~5x slower


_forward = jax.jit(lambda p, tokens: build(CFG).apply({"params": p}, tokens))


@pytest.fixture(scope="module")
def tmodel(params):
    return load_into(tbuild(CFG), params, ("layers",)).eval()


def _gen(params, prompt=PROMPTS, n=N_NEW, **kw):
    return np.asarray(generate(CFG, params, prompt, n, **kw))


def _support(samples, n_ids):
    """Sorted ids drawn at least once, per row of ``samples`` (rows, draws)."""
    return [set(np.flatnonzero(np.bincount(np.asarray(r).ravel(), minlength=n_ids)).tolist()) for r in samples]


def _kept(logits, temperature=1.0, top_k=None, top_p=None):
    """Expected surviving ids per row (numpy), and the renormalised probabilities over them."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    if top_k is not None:
        kth = np.sort(z, -1)[:, -top_k][:, None]
        keep &= z >= kth
    if top_p is not None:
        zz = np.where(keep, z, -np.inf)
        order = np.argsort(-zz, -1)
        p = np.exp(np.take_along_axis(zz, order, -1) - zz.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        before = np.cumsum(p, -1) - p
        drop = np.zeros_like(keep)
        np.put_along_axis(drop, order, before > top_p, -1)
        keep &= ~drop
    probs = np.where(keep, np.exp(z - z.max(-1, keepdims=True)), 0.0)
    probs /= probs.sum(-1, keepdims=True)
    return [set(np.flatnonzero(k).tolist()) for k in keep], probs


# 1. Sampling: same rng -> same tokens with and without the cache --------------------------------
@pytest.mark.parametrize("setting", sorted(SAMPLED))
def test_sampling_same_rng_same_tokens_with_and_without_cache(params, setting):
    kw = SAMPLED[setting]
    key = jax.random.PRNGKey(7)
    cached = _gen(params, rng=key, **kw)
    assert cached.shape == (3, 5 + N_NEW)
    assert np.array_equal(cached[:, :5], PROMPTS)
    assert np.array_equal(cached, _gen(params, rng=key, use_cache=False, **kw))
    assert np.array_equal(cached, _gen(params, rng=key, **kw))  # deterministic given the key
    # Sanity: the samples depend on the key and are not just the greedy continuation.
    other = _gen(params, rng=jax.random.PRNGKey(8), **kw)
    assert not np.array_equal(cached[:, 5:], other[:, 5:])
    # Every sampled token is inside the filter's kept set of the model's logits at that step.
    logits = np.asarray(_forward(params, cached[:, :-1]), np.float64)[:, 4:]  # predict 5..
    for t in range(N_NEW):
        kept, _ = _kept(logits[:, t] + 0.0, kw["temperature"], kw.get("top_k"), kw.get("top_p"))
        for b in range(3):
            tok = int(cached[b, 5 + t])
            if tok in kept[b]:
                continue
            # tolerate a float-level borderline between incremental and full-forward logits
            z = logits[b, t] / kw["temperature"]
            if "top_k" in kw:
                assert z[tok] >= np.sort(z)[-kw["top_k"]] - 1e-4, (b, t, tok)
            else:
                p = np.exp(z - z.max())
                p /= p.sum()
                assert p[p > p[tok]].sum() <= kw["top_p"] + 1e-4, (b, t, tok)


# 2. sample_logits -----------------------------------------------------------------------------
N_DRAWS = 2000


def _draw(row, seed=0, **kw):
    """N_DRAWS samples from one logits row (one categorical per broadcast row, so one call)."""
    return np.asarray(sample_logits(jnp.broadcast_to(jnp.asarray(row, jnp.float32), (N_DRAWS, len(row))),
                                    jax.random.PRNGKey(seed), **kw))


def test_sample_logits_top_k_keeps_exactly_the_k_largest():
    row = np.random.default_rng(1).standard_normal(20).astype(np.float32)
    top5 = set(np.argsort(-row)[:5].tolist())
    s = _draw(row, top_k=5)
    assert set(s.tolist()) == top5  # subset, and every one of the 5 (each has prob > 0.1) appears
    assert set(_draw(row, top_k=1).tolist()) == {int(np.argmax(row))}
    assert len(set(_draw(row, top_k=100).tolist())) > 10  # k > V keeps everything


def test_sample_logits_top_p_keeps_smallest_prefix_reaching_p():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert set(_draw(row, top_p=0.7).tolist()) == {0, 1}
    assert set(_draw(row, top_p=0.4).tolist()) == {0}
    assert set(_draw(row, top_p=0.85).tolist()) == {0, 1, 2}
    assert set(_draw(row, top_p=1.0).tolist()) == {0, 1, 2, 3}
    # top_p after temperature: at T=4 the probabilities flatten to ~[.30,.27,.23,.20], so 0.7 needs 3 tokens
    assert set(_draw(row, temperature=4.0, top_p=0.7).tolist()) == {0, 1, 2}


def test_sample_logits_top_p_exact_boundary():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))  # softmax gives exactly 0.5 for id 0
    assert set(_draw(row, top_p=0.5).tolist()) == {0}


def test_sample_logits_temperature():
    logits = np.random.default_rng(2).standard_normal((6, 30)).astype(np.float32)
    greedy = np.asarray(sample_logits(logits, jax.random.PRNGKey(0), temperature=0.0))
    assert greedy.dtype == np.int32 and np.array_equal(greedy, np.argmax(logits, -1))
    assert np.array_equal(greedy, np.asarray(sample_logits(logits, None, temperature=0.0, top_k=3)))  # rng unused
    # Frequencies follow softmax(logits / T): T=2 turns [.5, .3, .15, .05] into sqrt(p) / sum.
    p = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.log(p).astype(np.float32)
    s = np.asarray(sample_logits(jnp.broadcast_to(row, (20000, 4)), jax.random.PRNGKey(3), temperature=2.0))
    want = np.sqrt(p) / np.sqrt(p).sum()
    assert np.max(np.abs(np.bincount(s, minlength=4) / 20000 - want)) < 0.015


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_k=0), dict(top_k=-2), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_p=-0.2)])
def test_sample_logits_bad_arguments(kw):
    with pytest.raises(ValueError):
        sample_logits(jnp.zeros((2, 10)), jax.random.PRNGKey(0), **{"temperature": 1.0, **kw})


# 3. EOS -----------------------------------------------------------------------------------------
def _apply_eos(tokens, t0, eos):
    """What generation with ``eos`` must give, from the same-rng run without it: each row unchanged up
    to and including its first generated eos, eos afterwards (rows are sampled independently)."""
    out = tokens.copy()
    for row in out:
        hits = np.flatnonzero(row[t0:] == eos)
        if hits.size:
            row[t0 + hits[0]:] = eos
    return out


def test_eos_sampled_rows_stay_eos_cached_and_uncached(params):
    key = jax.random.PRNGKey(7)
    free = _gen(params, rng=key, **SAMPLED["temp"])  # same compile as the test above
    eos = int(free[0, 5 + 3])  # row 0 emits it by step 3
    want = _apply_eos(free, 5, eos)
    assert not np.array_equal(want, free)
    for use_cache in (True, False):
        out = _gen(params, rng=key, eos_id=eos, use_cache=use_cache, **SAMPLED["temp"])
        assert out.shape == (3, 5 + N_NEW)
        assert np.array_equal(out, want), use_cache
        first = np.argmax(out[0, 5:] == eos)
        assert first <= 3 and np.all(out[0, 5 + first:] == eos)


def test_eos_greedy_all_rows_done_early_matches_torch_ref(params, tmodel):
    prompt = PROMPTS[:1]
    free = tgenerate(tmodel, torch.from_numpy(prompt), N_NEW).numpy()  # greedy parity: test_decoder.py
    eos = int(free[0, 5 + 2])
    want = _apply_eos(free, 5, eos)
    assert np.sum(want[0, 5:] == eos) >= N_NEW - 2  # the cached loop stops early; the tail is filled
    cached = _gen(params, prompt, eos_id=eos)
    assert cached.shape == (1, 5 + N_NEW)
    assert np.array_equal(cached, want)
    assert np.array_equal(_gen(params, prompt, eos_id=eos, use_cache=False), want)
    for use_cache in (True, False):
        t = tgenerate(tmodel, torch.from_numpy(prompt), N_NEW, eos_id=eos, use_cache=use_cache).numpy()
        assert np.array_equal(t, want), use_cache


# 4. Crop fallback -------------------------------------------------------------------------------
def test_crop_fallback_past_max_len(params, tmodel):
    prompt = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 10)).astype(np.int32)
    n = 40  # 10 + 40 > max_len=32: falls back to the uncached path, cropping to the last 32 tokens
    fit = CFG.max_len - 10  # 22 new tokens still fit the cache
    with pytest.warns(UserWarning, match="prompt length 10 \\+ max_new_tokens 40 exceeds max_len=32: decoding "
                      "without the KV cache, each token seeing only the last 32 tokens"):
        greedy = _gen(params, prompt, n)
    assert greedy.shape == (2, 10 + n)
    assert np.array_equal(greedy[:, :10], prompt)
    # Until the window fills nothing is cropped: the prefix is the cached generation of `fit` tokens.
    assert np.array_equal(greedy[:, :CFG.max_len], _gen(params, prompt, fit))
    # Past it, each token is the argmax over the last max_len tokens: torch_ref's plain loop, both paths.
    for use_cache in (True, False):
        t = tgenerate(tmodel, torch.from_numpy(prompt), n, use_cache=use_cache).numpy()
        assert np.array_equal(greedy, t), use_cache


def test_generate_within_max_len_does_not_warn(params):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _gen(params, PROMPTS, CFG.max_len - PROMPTS.shape[1])


def test_unseeded_sampling_draws_fresh_entropy(params):
    # Without rng, two sampled calls differ (the server's rule for an unseeded request); 3 rows x 20 tokens at
    # ~1.5 nats each would repeat with probability ~e^-90. Greedy decoding needs no key and repeats.
    a, b = _gen(params, temperature=1.0), _gen(params, temperature=1.0)
    assert not np.array_equal(a, b)
    assert np.array_equal(_gen(params), _gen(params))
    key = jax.random.PRNGKey(7)
    assert np.array_equal(_gen(params, temperature=1.0, rng=key), _gen(params, temperature=1.0, rng=key))


@pytest.mark.parametrize("form", [np.asarray, lambda x: x.tolist()], ids=["numpy", "list"])
def test_apply_takes_numpy_arrays_and_lists(params, form):
    model = build(CFG)
    want = np.asarray(model.apply({"params": params}, jnp.asarray(PROMPTS)))
    got = np.asarray(model.apply({"params": params}, form(PROMPTS)))
    assert np.array_equal(got, want)


# 5. One compilation per setting -----------------------------------------------------------------
def test_generate_compiles_once_per_shape_and_setting(params):
    kw = dict(temperature=0.8, top_k=5)
    a = _gen(params, PROMPTS, rng=jax.random.PRNGKey(1), **kw)
    size = gen_module._generate_cached._cache_size()
    assert size >= 1
    other = (PROMPTS + 1) % CFG.vocab_size
    b = _gen(params, other, rng=jax.random.PRNGKey(2), **kw)
    c = _gen(params, other.tolist(), rng=jax.random.PRNGKey(2), temperature=0.8, top_k=5)  # list prompt
    assert gen_module._generate_cached._cache_size() == size
    assert not np.array_equal(a[:, 5:], b[:, 5:]) and np.array_equal(b, c)
    assert np.array_equal(b[:, :5], other)


# 6. Errors --------------------------------------------------------------------------------------
def test_generate_argument_errors(params):
    with pytest.raises(ValueError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        generate(CFG, params, np.array([[1, 50]]), 3)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(CFG, params, np.array([[-1, 2]]), 3)
    with pytest.raises(ValueError, match="prompt must be"):
        generate(CFG, params, np.zeros((1, 0), np.int32), 3)
    with pytest.raises(ValueError, match="prompt must be"):
        generate(CFG, params, np.array([1, 2, 3]), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(CFG, params, PROMPTS, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(CFG, params, PROMPTS, -1)
    with pytest.raises(ValueError, match="eos_id 50 is outside"):
        generate(CFG, params, PROMPTS, 3, eos_id=50)
    with pytest.raises(ValueError, match="eos_id -1 is outside"):
        generate(CFG, params, PROMPTS, 3, eos_id=-1)
    with pytest.raises(ValueError, match="exceed max_len=32"):
        generate(CFG, params, np.zeros((1, 33), np.int32), 3)


# 7. torch_ref's filters keep the same ids -------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8),
                                dict(temperature=1.3, top_k=10, top_p=0.6)])
def test_torch_ref_sampling_filters_match(kw):
    logits = (2.0 * np.random.default_rng(4).standard_normal((4, 50))).astype(np.float32)
    kept, probs = _kept(logits, **kw)
    reps = 1000
    big = np.repeat(logits, reps, axis=0)  # (4 * reps, 50): one draw per row
    j = np.asarray(sample_logits(jnp.asarray(big), jax.random.PRNGKey(0), **kw)).reshape(4, reps)
    t = tsample_logits(torch.from_numpy(big), generator=torch.Generator().manual_seed(0), **kw).numpy()
    t = t.reshape(4, reps)
    for b in range(4):
        likely = {i for i in kept[b] if probs[b, i] > 0.02}  # miss chance < 1e-8 at 1000 draws
        assert len(kept[b]) > 1
        for name, s in (("jaxgpt", j), ("torch_ref", t)):
            got = _support(s[b:b + 1], 50)[0]
            assert got <= kept[b], (name, b, sorted(got - kept[b]))
            assert likely <= got, (name, b, sorted(likely - got))
    # temperature 0 is argmax in torch_ref too
    assert np.array_equal(tsample_logits(torch.from_numpy(logits), temperature=0.0).numpy(), np.argmax(logits, -1))


def test_cached_generation_with_bfloat16_params(params):
    """Regression: the cache was always float32, so bf16 params failed in the cached write.
    Self-consistency: greedy cached and uncached decoding of the same bf16 weights agree."""
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    cached = np.asarray(generate(CFG, p16, PROMPTS, 8))
    uncached = np.asarray(generate(CFG, p16, PROMPTS, 8, use_cache=False))
    assert cached.shape == (3, 13)
    np.testing.assert_array_equal(cached, uncached)
