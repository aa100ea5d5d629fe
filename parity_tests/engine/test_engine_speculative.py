"""Speculative decoding inside the engine (``Engine(draft=...)``: speculative.speculate).

Greedy: token-identical to transformers' ``generate`` on each request alone (the reference the
test did not compute), with two drafts: one that always agrees (the target itself: every
round emits k + 1 tokens) and one that agrees often (the target with perturbed weights: accepted
prefixes of every length, rejections); under ragged arrivals, chunked prefill and forced
preemption; with speculation switched off above ``spec_max_batch`` running requests and
back on below it; and with the auto rule (``spec_max_batch='auto'``, the default) flipping it
by a scripted cost model. A draft of another shape than the target's runs in the sampling test and in
test_serve.py's ``--draft`` test. Sampling: the engine's second and
third tokens are distributed as the target's own (temperature 0.8, top-k 4 of a 5-token
vocabulary), the reference computed here from the target's logits in NumPy, within 4.5
standard errors over 2000 requests.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference import speculative
from jaxgpt.inference.engine import Engine
from jaxgpt.inference.sampling import SamplingParams
from jaxgpt.inference.spec_policy import SpecPolicy
from jaxgpt.models import init_params
from test_engine import _run_staggered, llama, references  # noqa: F401  (module fixtures, HF references)

K = 3


def _perturbed(params, scale, seed=0):
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [x * (1 + scale * jax.random.normal(k, x.shape, x.dtype))
                                               for x, k in zip(leaves, keys)])


def _drafts(config, params):
    # 3% noise: on test_engine's weights its rounds accept each of 0..K proposals (with 10% almost every round accepted none)
    return {"itself": (config, params), "perturbed": (config, _perturbed(params, 0.03))}


# one engine setting for every draft, so the drafts sharing the target's config share its programs
CHUNKED = dict(max_seqs=4, max_tokens_per_step=16, num_pages=9)  # chunked prefill, forced preemption


@pytest.mark.parametrize("draft", ["itself", "perturbed"])  # a draft of another shape: the sampling test's
def test_greedy_with_a_draft_identical_to_hf(llama, references, draft):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    _, config, params = llama
    prompts, news, hf, _ = references
    eng = Engine(config, params, page_size=8, draft=_drafts(config, params)[draft], num_speculative_tokens=K,
                 **CHUNKED)
    assert _run_staggered(eng, prompts, news) == hf
    assert eng.allocator.free == eng.allocator.total
    s = eng.stats
    rate = s["spec_accepted"] / s["spec_proposed"]
    assert {"itself": rate == 1.0, "perturbed": 0.2 < rate < 1.0}[draft], rate
    assert s["preemptions"] > 0
    # the default auto rule was fed this machine's call times (some bucket holds both) and the acceptance
    est = eng.spec_policy.estimates()
    assert any(e["wins"] is not None for e in est["buckets"].values()), est
    assert {"itself": est["alpha"] > 0.9, "perturbed": 0.2 < est["alpha"] < 1.0}[draft], est


@pytest.mark.parametrize("limit", [2])  # 1 too would double the time for the same paths
def test_speculation_turns_off_above_spec_max_batch_and_back_on(llama, references, limit):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """Above ``spec_max_batch`` running requests, rows take plain decode steps (the draft's pages
    fall behind); when the batch shrinks they speculate again after the draft is fed the tokens it
    missed. With the target as its own draft every proposal is accepted only if the draft's pages
    hold every token: a skipped catch-up shows as a rate below 1 (tried: 17 of 129 accepted; with
    HF's 0.02 init, 45 of 54)."""
    _, config, params = llama
    prompts, news, hf, _ = references
    eng = Engine(config, params, page_size=8, draft=(config, params), num_speculative_tokens=K,
                 spec_max_batch=limit, **CHUNKED)
    seen = []
    step = eng.step

    def spy():
        n_running, before = len(eng.running), eng.stats["spec_proposed"]
        outs = step()
        seen.append((n_running, eng.stats["spec_proposed"] > before))
        return outs

    eng.step = spy
    assert _run_staggered(eng, prompts, news) == hf
    assert eng.allocator.free == eng.allocator.total and not eng.scheduler.draft_at
    assert not any(spec for n, spec in seen if n > limit)  # off above the limit (running counted after admission)
    assert any(spec for n, spec in seen if n <= limit)
    s = eng.stats
    assert s["spec_catch_up_tokens"] > 0  # requests came back to speculation after plain steps
    assert s["spec_accepted"] == s["spec_proposed"], (s["spec_accepted"], s["spec_proposed"])


class ScriptedCosts(SpecPolicy):
    """The auto rule with the test's cost model in place of the machine's clock: a plain step costs
    1, a round 1 at one row (it wins) and 100 at more (it loses). Re-explores every 4th step of a
    bucket, so the rule flips back and forth within the test. Logs each step's (bucket, decision)."""

    def __init__(self, k):
        super().__init__(k, explore_every=4)
        self.log = []

    def record_time(self, speculative, bucket, seconds):
        super().record_time(speculative, bucket, 100.0 if speculative and bucket > 1 else 1.0)

    def speculates(self, bucket):
        self.log.append((bucket, super().speculates(bucket)))
        return self.log[-1][1]


def test_auto_rule_flips_speculation_and_keeps_greedy_tokens(llama, references):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """spec_max_batch='auto' (the default): the engine feeds the policy its call times and each
    round's acceptance and asks it each step. With the scripted costs speculation is off at 2-4
    decoding rows (but for explorations) and on at one, and the draft is caught up at each switch
    back: the target as its own draft keeps every proposal accepted, tokens stay transformers'."""
    _, config, params = llama
    prompts, news, hf, _ = references
    eng = Engine(config, params, page_size=8, draft=(config, params), num_speculative_tokens=K, **CHUNKED)
    assert eng.spec_max_batch == "auto" and isinstance(eng.spec_policy, SpecPolicy)
    eng.scheduler.spec_policy = pol = ScriptedCosts(K)
    assert _run_staggered(eng, prompts, news) == hf
    assert eng.allocator.free == eng.allocator.total and not eng.scheduler.draft_at
    s = eng.stats
    assert s["spec_accepted"] == s["spec_proposed"] > 0, (s["spec_accepted"], s["spec_proposed"])
    assert s["spec_catch_up_tokens"] > 0
    on_small = [on for b, on in pol.log if b == 1]
    on_large = [on for b, on in pol.log if b > 1]
    assert any(on_small) and not all(on_large) and any(on_large)  # both modes, explorations above one row
    assert sum(on_large) < len(on_large) / 2 and sum(on_small) > len(on_small) / 2
    assert s["spec_off_steps"] == sum(not on for _, on in pol.log)  # the engine did as the rule said
    assert 0 < s["spec_rounds"] <= sum(on for _, on in pol.log)
    assert pol.alpha > 0.9 and pol.wins(1) and pol.wins(2) is False


@pytest.mark.slow  # ~14 s: make test-slow (make test keeps the fast tier under 10 min)
def test_precompile_covers_the_speculative_shapes(llama, references):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    _, config, params = llama
    prompts, news, hf, _ = references
    eng = Engine(config, params, page_size=8, draft=_drafts(config, params)["perturbed"], num_speculative_tokens=K,
                 **CHUNKED)
    assert eng.precompile() == len(eng.buckets()) == eng.compilations
    assert any(kind == "spec" for kind, *_ in eng.buckets())
    size = speculative.speculate._cache_size()
    assert _run_staggered(eng, prompts, news) == hf  # precompile's padding rows left both pools alone
    assert speculative.speculate._cache_size() == size
    assert eng.compilations == len(eng.buckets())


def _exact_distributions(config, params, prompt, temperature, top_k):
    """P(t2) and P(t3) of a 3-token continuation sampled from the target with these settings, by
    enumerating every prefix through full (uncached) forward passes."""
    from jaxgpt.models.decoder import DecoderLM

    v = config.vocab_size
    forward = jax.jit(lambda tokens: DecoderLM(config).apply({"params": params}, tokens)[:, -1])

    def dist(prefixes):  # (N, T) -> (N, V) the filtered, tempered next-token distributions
        logits = np.asarray(forward(np.asarray(prefixes, np.int32)))
        x = logits.astype(np.float64) / temperature
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(v)])  # (V, V): p(t2 | t1)
    p3 = dist([prompt + [a, b] for a in range(v) for b in range(v)]).reshape(v, v, v)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))


@pytest.mark.slow  # 2,000 sampled requests, ~30 s: make test-slow
def test_sampling_with_a_draft_keeps_the_target_distribution():
    target = ModelConfig(vocab_size=5, d_model=16, n_layer=2, n_head=2, max_len=32, pos="rope")
    draft = ModelConfig(vocab_size=5, d_model=8, n_layer=1, n_head=1, max_len=32, pos="rope")
    tp, dp = init_params(target, jax.random.PRNGKey(0)), init_params(draft, jax.random.PRNGKey(1))
    tp = jax.tree_util.tree_map(lambda x: 3 * x, tp)  # sharper, so p and q differ and rejections happen
    prompt, n, temperature, top_k = [1, 2, 3], 2000, 0.8, 4
    eng = Engine(target, tp, max_seqs=128, page_size=8, max_tokens_per_step=512, draft=(draft, dp),
                 num_speculative_tokens=2, spec_max_batch=128)  # every round speculative
    outs = eng.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=s)
                                       for s in range(n)])
    rate = eng.stats["spec_accepted"] / eng.stats["spec_proposed"]
    assert 0.1 < rate < 0.95, rate  # both paths of the rule are taken
    want2, want3 = _exact_distributions(target, tp, prompt, temperature, top_k)
    for col, want in ((1, want2), (2, want3)):
        freq = np.bincount([o[col] for o in outs], minlength=5) / n
        se = np.sqrt(want * (1 - want) / n) + 1e-12
        assert np.all(np.abs(freq - want) <= 4.5 * se), (col, freq, want)


def test_draft_errors_name_the_value(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    _, config, params = llama
    small = ModelConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, max_len=64, pos="rope")
    with pytest.raises(ValueError, match=r"draft's vocabulary \(50\) differs from the target's \(96\)"):
        Engine(config, params, draft=(small, init_params(small, jax.random.PRNGKey(0))))
    short = dataclasses.replace(config, max_len=32)
    with pytest.raises(ValueError, match=r"draft's context \(32\) is shorter than the target's max_model_len \(64\)"):
        Engine(config, params, draft=(short, params))
    for bad in (0, "always", 2.0, True):
        with pytest.raises(ValueError, match=f"spec_max_batch must be 'auto' or an int >= 1, got {bad!r}"):
            Engine(config, params, draft=(config, params), spec_max_batch=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        Engine(config, params, draft=(config, params), num_speculative_tokens=0)
    with pytest.raises(ValueError, match="takes num_speculative_tokens \\+ 1 = 9 tokens of max_tokens_per_step=8"):
        Engine(config, params, draft=(config, params), num_speculative_tokens=8, max_tokens_per_step=8)
