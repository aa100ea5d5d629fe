"""The engine's OpenAI sampling features (jaxgpt/inference/sampling.py, engine.py): presence and
frequency penalties, logit_bias, top_logprobs and unseeded (fresh) seeds.

References the test did not compute itself: transformers' logits of a random HF LLaMA (the
fixture test_engine.py shares) on each request's prompt + outputs so far, turned into the next
greedy token by the OpenAI/vLLM formula in NumPy (logits + bias - presence * (count > 0)
- frequency * count, over the request's output tokens), and into log-probabilities by a float64
log-softmax (vLLM's default raw logprobs: before bias, penalties and temperature). Tolerances:
tokens exact (greedy; no near-ties on these prompts), log-probabilities 1e-4 (float32 paths).
Self-consistency checks are labelled as such.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxgpt.inference import speculative
from jaxgpt.inference.engine import Engine
from jaxgpt.inference.sampling import SamplingParams, select_tokens
from test_engine import llama  # noqa: F401  (module fixture: HF model, jaxgpt config, params)

SMALL = dict(max_seqs=4, page_size=8, max_tokens_per_step=64, num_pages=40)
PROMPTS = ([5, 6, 7, 8], [9, 10, 11], [12, 3, 40, 41, 42, 7])


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()  # (V,)


def _adjust(v: int, params: SamplingParams, output) -> np.ndarray:
    """The OpenAI/vLLM formula in NumPy: bias minus the penalties of the output so far (V,)."""
    adj = np.zeros(v)
    for tok, b in params.logit_bias:
        adj[tok] += b
    count = np.bincount(np.asarray(output, np.int64), minlength=v).astype(np.float64)
    return adj - params.presence_penalty * (count > 0) - params.frequency_penalty * count


def _reference_greedy(model, prompt, params: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(params.max_tokens):
        logits = _hf_logits(model, prompt + out)
        out.append(int(np.argmax(logits + _adjust(logits.size, params, out))))
    return out


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_params_are_validated_with_the_value_and_the_limit(llama):  # noqa: F811 - the imported fixture
    for kw, msg in ((dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
                    (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\], got -3.0"),
                    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
                    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be a number in \[-100, 100\], got 101"),
                    (dict(logit_bias={-1: 1.0}), "logit_bias token id -1 is negative"),
                    (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "names token id 3 twice"),
                    (dict(logit_bias={"7": 1.0}), "token ids must be integers, got '7'"),
                    (dict(top_logprobs=21, logprobs=True), r"top_logprobs must be in \[0, 20\], got 21"),
                    (dict(top_logprobs=2), "top_logprobs=2 needs logprobs=True"),
                    (dict(seed=2 ** 32), r"seed must be in \[0, 2\*\*32\) or None"),
                    (dict(seed=-1), "got -1")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    p = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert p.logit_bias == ((2, 0.5), (9, -1.0)) and p.adjusts_logits and not SamplingParams().adjusts_logits
    assert SamplingParams().seed is None and SamplingParams().max_tokens == 16 and SamplingParams().temperature == 0
    _, config, params = llama
    with pytest.raises(ValueError, match=r"logit_bias token id 96 is outside the vocabulary \[0, 96\)"):
        Engine(config, params, **SMALL).add_request([5], SamplingParams(logit_bias={96: 1.0}))


def test_select_tokens_adjust_matches_numpy():
    """Function level: greedy rows take NumPy's argmax of logits + adjust (reference); sampled rows
    draw what the plain program draws from the NumPy-adjusted logits with the same keys
    (self-consistency); logprobs are the unadjusted log-softmax (reference)."""
    rng = np.random.default_rng(0)
    b, v, k = 6, 50, 8
    logits = rng.normal(size=(b, v)).astype(np.float32)
    ids = np.stack([rng.permutation(v)[:k] for _ in range(b)]).astype(np.int32)
    vals = rng.normal(scale=3.0, size=(b, k)).astype(np.float32)
    adjusted = logits.copy()
    np.add.at(adjusted, (np.arange(b)[:, None], ids), vals)
    temp = np.array([0, 0, 0, 1.0, 0.7, 1.0], np.float32)
    settings = (temp, np.zeros(b, np.int32), np.ones(b, np.float32), np.arange(b, dtype=np.uint32),
                np.full(b, 3, np.int32))
    tok, logp = jax.jit(select_tokens)(logits, *settings, True, (ids, vals))
    plain, _ = jax.jit(select_tokens)(adjusted, *settings, True)
    tok, plain = np.asarray(tok), np.asarray(plain)
    assert (tok[:3] == adjusted[:3].argmax(-1)).all() and (tok[:3] != logits[:3].argmax(-1)).any()
    assert (tok == plain).all()
    want = np.array([_log_softmax(logits[i].astype(np.float64))[tok[i]] for i in range(b)])
    np.testing.assert_allclose(np.asarray(logp), want, atol=1e-5)


def test_greedy_penalties_and_bias_match_the_reference(llama):  # noqa: F811
    model, config, params = llama
    settings = [SamplingParams(max_tokens=10, presence_penalty=1.5),
                SamplingParams(max_tokens=10, frequency_penalty=0.7),
                SamplingParams(max_tokens=10, presence_penalty=-0.5, frequency_penalty=2.0,
                               logit_bias={20: 3.0, 21: -2.5, 95: 1.0}),
                SamplingParams(max_tokens=10),
                # a repeat once rewarded, then penalised: tells presence (once) from frequency (each time)
                SamplingParams(max_tokens=10, presence_penalty=-0.5, frequency_penalty=0.3)]
    eng = Engine(config, params, **SMALL)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # 1 and 2 repeat tokens when greedy
    got = eng.generate(prompts, settings)  # one batch: adjusted and plain rows together
    want = [_reference_greedy(model, p, s) for p, s in zip(prompts, settings)]
    assert got == want
    plain = eng.generate(prompts, [SamplingParams(max_tokens=10)] * len(prompts))
    assert all((g != p) == s.adjusts_logits for g, p, s in zip(got, plain, settings))  # each setting mattered
    assert eng.allocator.free == eng.allocator.total


def test_greedy_bias_bans_and_forces_tokens(llama):  # noqa: F811
    _, config, params = llama
    eng = Engine(config, params, **SMALL)
    for prompt in PROMPTS:
        free = eng.generate([prompt], [SamplingParams(max_tokens=12)])[0]
        banned = set(free[:3])
        out = eng.generate([prompt], [SamplingParams(max_tokens=12, logit_bias={t: -100 for t in banned})])[0]
        assert not banned & set(out), (free, out)
        assert eng.generate([prompt], [SamplingParams(max_tokens=5, logit_bias={33: 100})])[0] == [33] * 5


def test_top_logprobs_are_the_models_sorted_log_softmax(llama):  # noqa: F811
    """The chosen token's logprob and its top alternatives against a float64 log-softmax of HF's
    logits (raw: the bias and temperature do not enter), for a greedy and a sampled request."""
    model, config, params = llama
    eng = Engine(config, params, **SMALL)
    settings = [SamplingParams(max_tokens=6, logprobs=True, top_logprobs=5, logit_bias={40: 2.0}),
                SamplingParams(max_tokens=6, temperature=1.3, seed=7, logprobs=True, top_logprobs=20),
                SamplingParams(max_tokens=6, logprobs=True)]
    rids = [eng.add_request(p, s) for p, s in zip(PROMPTS, settings)]
    outs = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            assert len(o.new_top_logprobs) == len(o.new_token_ids) == 1
            outs[o.id].append(o)
    for prompt, s, rid in zip(PROMPTS, settings, rids):
        toks = [o.new_token_ids[0] for o in outs[rid]]
        assert len(toks) == 6
        for i, o in enumerate(outs[rid]):
            ref = _log_softmax(_hf_logits(model, prompt + toks[:i]))
            top = o.new_top_logprobs[0]
            assert len(top) == s.top_logprobs
            np.testing.assert_allclose(o.new_logprobs[0], ref[toks[i]], atol=1e-4)
            if not top:
                continue
            ids, lps = [t for t, _ in top], np.array([lp for _, lp in top])
            assert ids == list(np.argsort(-ref, kind="stable")[:len(ids)])
            assert (np.diff(lps) <= 0).all()
            np.testing.assert_allclose(lps, ref[ids], atol=1e-4)
            if toks[i] in ids:  # the same distribution as the chosen token's logprob
                assert lps[ids.index(toks[i])] == pytest.approx(o.new_logprobs[0], abs=1e-6)


def test_unseeded_requests_differ_and_seeded_ones_repeat(llama):  # noqa: F811
    _, config, params = llama
    eng = Engine(config, params, **SMALL)
    sp = SamplingParams(max_tokens=16, temperature=1.0)
    rids = [eng.add_request(PROMPTS[0], sp) for _ in range(2)]
    seeds = [eng.requests[r].seed for r in rids]
    done = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            done[o.id] += o.new_token_ids
    a, b = done[rids[0]], done[rids[1]]
    assert a != b and seeds[0] != seeds[1]
    # the recorded seed reruns it, alone or beside other requests
    again = Engine(config, params, **SMALL).generate(
        [PROMPTS[1], PROMPTS[0]], [SamplingParams(max_tokens=5, temperature=0.5),
                                   SamplingParams(max_tokens=16, temperature=1.0, seed=seeds[0])])[1]
    assert again == a


def test_seeded_adjusted_rows_ignore_their_batch(llama):  # noqa: F811
    """Self-consistency: a seeded sampling request with penalties and a bias yields the same tokens
    alone and in a batch whose other rows change the call's row and bias buckets, with forced
    preemption (its counts survive the recompute)."""
    _, config, params = llama
    sp = SamplingParams(max_tokens=14, temperature=1.0, top_k=30, seed=11, presence_penalty=1.0,
                        frequency_penalty=0.5, logit_bias={7: -3.0, 50: 2.0, 51: 2.0})
    alone = Engine(config, params, **SMALL).generate([PROMPTS[0]], [sp])[0]
    others = [SamplingParams(max_tokens=12, temperature=0.8, seed=1, logit_bias={i: 0.5 for i in range(3, 60)}),
              SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=1.0, seed=2)]
    crowd = Engine(config, params, max_seqs=4, page_size=8, max_tokens_per_step=16, num_pages=9)
    # last admitted, so the first preempted: it is recomputed from its prompt and outputs
    got = crowd.generate([PROMPTS[1], [3] * 20, PROMPTS[2], PROMPTS[0]], others + [sp])
    assert got[3] == alone
    assert crowd.stats["preemptions"] > 0
    unpenalised = Engine(config, params, **SMALL).generate([PROMPTS[0]], [SamplingParams(
        max_tokens=14, temperature=1.0, top_k=30, seed=11)])[0]
    assert unpenalised != alone and {50, 51} & set(alone)


def test_a_draft_engine_decodes_adjusted_requests_plainly(llama):  # noqa: F811
    """Speculative rounds do not apply bias, penalties or top logprobs, so such requests decode
    plainly on a draft engine (no proposals) and get the reference's tokens. (A plain request's
    rounds are test_engine_speculative.py's; running one here would compile the round.)"""
    model, config, params = llama
    eng = Engine(config, params, draft=(config, params), num_speculative_tokens=2, **SMALL)
    sp = SamplingParams(max_tokens=8, frequency_penalty=1.0, logit_bias={30: 2.0})
    assert eng.generate([PROMPTS[1]], [sp])[0] == _reference_greedy(model, PROMPTS[1], sp)
    assert eng.stats["spec_proposed"] == 0
    top = SamplingParams(logprobs=True, top_logprobs=1)
    assert speculative.supports(SamplingParams(temperature=0.5, seed=3, logprobs=True)) and not any(
        speculative.supports(s) for s in (sp, top, SamplingParams(presence_penalty=0.1)))
