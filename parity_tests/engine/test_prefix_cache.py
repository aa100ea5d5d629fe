"""Automatic prefix caching (jaxgpt/inference/prefix_cache.py, ``Engine(enable_prefix_caching=)``).

Exactness: greedy tokens with the cache equal transformers' ``generate`` on each request alone (a
reference the test did not compute) and the engine's own without the cache (self-consistency), on
requests sharing prefixes: ragged suffixes, a prompt entirely cached, a prefix shorter than a page,
a repeated prompt, mid-flight arrivals, chunked prefill with preemption under a tiny page budget,
eviction under pressure, int8 pages, a draft model. Reuse: the hit counters, and the tokens the
engine computed fall by exactly the tokens hit. Accounting: at the end every page is free or
cached and evictable, no reference held. The allocator's rules (free pages first, LRU eviction,
tail pages evicted before the pages they extend, exact keys) have unit tests of their own.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxgpt.inference.engine import Engine
from jaxgpt.inference.prefix_cache import ROOT, PrefixCachingAllocator
from jaxgpt.inference.sampling import SamplingParams
from test_engine import _hf_greedy, llama  # noqa: F401  (the module fixture: context-sensitive HF LLaMA)

PAGE = 8


def _workload(seed=0):
    """Prompts sharing a 20-token system prefix (two full pages and a half), plus edge cases."""
    rng = np.random.default_rng(seed)
    tok = lambda n: [int(x) for x in rng.integers(3, 96, n)]
    system = tok(20)
    prompts = [system + tok(int(rng.integers(1, 11))) for _ in range(6)]
    prompts += [system[:16],  # page-aligned and entirely cached: its last page is recomputed
                system[:5] + tok(3),  # shares less than a page: no hit
                list(prompts[0]),  # a repeat: cached up to its last token's page
                system[8:16] + tok(5)]  # a cached page's tokens at another position: no hit
    news = [int(rng.integers(2, 14)) for _ in prompts]
    return prompts, news


def _counting(eng):
    """Count the tokens each call computes (prefill, decode and speculative rows)."""
    eng.ran = 0
    run = eng._run

    def spy(kind, rows):
        eng.ran += sum(n for _, n in rows)
        return run(kind, rows)

    eng._run = spy
    return eng


def _run_waves(eng, prompts, news):
    """The first three requests, then the rest arriving while those decode."""
    out, ids = {}, []
    for p, n in list(zip(prompts, news))[:3]:
        ids.append(eng.add_request(p, SamplingParams(max_tokens=n)))
    for _ in range(4):
        for o in eng.step():
            out.setdefault(o.id, []).extend(o.new_token_ids)
    for p, n in list(zip(prompts, news))[3:]:
        ids.append(eng.add_request(p, SamplingParams(max_tokens=n)))
    for _ in range(400):  # a request that never completes fails the test instead of hanging it
        for o in eng.step():
            out.setdefault(o.id, []).extend(o.new_token_ids)
        if not eng.has_unfinished():
            return [out[i] for i in ids]
    raise AssertionError("unfinished after 400 steps")


def _finish(eng, prompts, sp, max_steps=100):
    """generate(), but a request that never completes fails the test instead of hanging it."""
    ids = [eng.add_request(p, sp) for p in prompts]
    out = {i: [] for i in ids}
    for _ in range(max_steps):
        for o in eng.step():
            out[o.id] += o.new_token_ids
        if not eng.has_unfinished():
            return [out[i] for i in ids]
    raise AssertionError(f"unfinished after {max_steps} steps")


def _no_leaks(eng):
    a = eng.allocator
    assert a.free == a.total  # every page free or evictable
    if isinstance(a, PrefixCachingAllocator):
        assert all(a.refs(p) == 0 for p in range(1, a.num_pages))  # no reference left behind


@pytest.fixture(scope="module")
def workload(llama):  # noqa: F811 - the imported fixture
    model, _, _ = llama
    prompts, news = _workload()
    return prompts, news, [_hf_greedy(model, p, n) for p, n in zip(prompts, news)]


@pytest.mark.parametrize("kw", [dict(max_seqs=4, max_tokens_per_step=64, num_pages=40),
                                dict(max_seqs=4, max_tokens_per_step=16, num_pages=9),
                                dict(max_seqs=4, max_tokens_per_step=64, num_pages=40, kv_dtype="int8")],
                         ids=["roomy", "chunked+preempting", "int8"])
def test_greedy_identical_with_and_without_prefix_caching(llama, workload, kw):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    _, config, params = llama
    prompts, news, hf = workload
    on = _counting(Engine(config, params, page_size=PAGE, **kw))
    off = _counting(Engine(config, params, page_size=PAGE, enable_prefix_caching=False, **kw))
    got, want = _run_waves(on, prompts, news), _run_waves(off, prompts, news)
    assert got == want  # self-consistency: the cache changes no token
    if "kv_dtype" not in kw:  # int8 pages are not exact against float32 transformers (docs/serving.md)
        assert got == hf
    s = on.stats
    assert s["prefix_hits"] > 0 and off.stats["prefix_hits"] == 0
    assert s["prefix_queries"] >= sum(map(len, prompts))
    if s["preemptions"] == 0 and off.stats["preemptions"] == 0:
        # each request computes its prompt and outputs but the last output, less what it hit
        assert off.ran == sum(len(p) + len(o) - 1 for p, o in zip(prompts, want))
        assert on.ran == off.ran - s["prefix_hits"]
    else:
        assert on.ran < off.ran
    if kw["num_pages"] == 9:
        assert s["preemptions"] > 0  # the case this parametrisation exists for
    _no_leaks(on)
    _no_leaks(off)
    assert on.allocator.cached > 0


def test_hits_count_whole_pages_and_leave_the_last_token(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """A repeated page-aligned prompt hits all but its last page (the page that holds the token
    whose logits sample the next one is recomputed into a page of its own); a prompt one token
    longer hits both pages; a prefix shorter than a page never hits."""
    _, config, params = llama
    eng = Engine(config, params, max_seqs=4, page_size=PAGE, max_tokens_per_step=64, num_pages=40)
    p = list(range(10, 26))  # 16 tokens: two pages
    sp = SamplingParams(max_tokens=4)
    first = _finish(eng, [p], sp)
    for prompt, hit in ((p, 8), (p + [30], 16), (p[:7] + [40], 0), (p[:12], 8)):
        before = eng.stats["prefix_hits"]
        _finish(eng, [prompt], sp)
        assert eng.stats["prefix_hits"] - before == hit, prompt
    assert _finish(eng, [p], sp) == first
    _no_leaks(eng)


def test_requests_arriving_together_share_the_prefix(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """Four prompts with one 20-token prefix, all added before the first step: the later ones wait
    for the first to compute the shared pages instead of computing them too, then hit both."""
    _, config, params = llama
    prefix = list(range(3, 23))
    prompts = [prefix + [30 + i] for i in range(4)]
    on = Engine(config, params, max_seqs=4, page_size=PAGE, max_tokens_per_step=64, num_pages=40)
    off = Engine(config, params, max_seqs=4, page_size=PAGE, max_tokens_per_step=64, num_pages=40,
                 enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=5)
    assert on.generate(prompts, sp) == off.generate(prompts, sp)
    assert on.stats["prefix_hits"] == 3 * 16
    _no_leaks(on)


def test_pages_are_shared_while_running(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    _, config, params = llama
    eng = Engine(config, params, max_seqs=4, page_size=PAGE, max_tokens_per_step=64, num_pages=40)
    prefix = list(range(3, 20))
    a = eng.add_request(prefix + [40], SamplingParams(max_tokens=20))
    eng.step()
    b = eng.add_request(prefix + [41], SamplingParams(max_tokens=20))
    eng.step()
    ra, rb = eng.requests[a], eng.requests[b]
    assert ra.pages[:2] == rb.pages[:2] and ra.pages[2] != rb.pages[2]
    assert [eng.allocator.refs(p) for p in ra.pages[:3]] == [2, 2, 1]
    eng.abort(a)
    assert [eng.allocator.refs(p) for p in rb.pages[:2]] == [1, 1]
    eng.abort(b)
    _no_leaks(eng)


def test_eviction_under_pressure(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """Twelve distinct 30-token prompts through 12 allocatable pages: cached pages are evicted for
    new ones, a repeat of the latest prompt still hits, and every token equals the uncached engine's."""
    _, config, params = llama
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 96, 30)] for _ in range(12)]
    prompts.append(list(prompts[-1]))
    sp = SamplingParams(max_tokens=6)
    on = Engine(config, params, max_seqs=2, page_size=PAGE, max_tokens_per_step=32, num_pages=13)
    off = Engine(config, params, max_seqs=2, page_size=PAGE, max_tokens_per_step=32, num_pages=13,
                 enable_prefix_caching=False)
    assert on.generate(prompts, sp) == off.generate(prompts, sp)
    assert on.allocator.evictions > 0 and on.stats["prefix_hits"] == 24
    _no_leaks(on)


@pytest.mark.slow  # ~14 s, most of it compiling the speculative round: make test-slow
def test_with_a_draft_identical_and_hits(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """Speculative decoding: the draft's pools share the page ids, and a cached page holds both
    models' keys/values (it was filled by prefill chunks or speculative rounds)."""
    _, config, params = llama
    prompts, news = _workload(seed=1)
    kw = dict(max_seqs=4, page_size=PAGE, max_tokens_per_step=16, num_pages=12, draft=(config, params),
              num_speculative_tokens=3)
    on, off = Engine(config, params, **kw), Engine(config, params, enable_prefix_caching=False, **kw)
    assert _run_waves(on, prompts, news) == _run_waves(off, prompts, news)
    assert on.stats["prefix_hits"] > 0 and on.stats["spec_accepted"] == on.stats["spec_proposed"] > 0
    _no_leaks(on)


def test_a_page_the_draft_fell_behind_on_is_not_cached():
    """A 43-token prompt in a 66-token context, k = 3: speculative rounds take it to 63 tokens
    computed, then a round would pass the context, so a plain decode step writes position 63 into
    the target's pages only (the scheduler's ``draft_at``). That page (56-63) is not cached: a request sharing
    all 64 tokens hits 7 pages, not 8; with the rule removed, 8."""
    import jax

    from jaxgpt.config import ModelConfig
    from jaxgpt.models import init_params

    config = ModelConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_len=66, pos="rope")
    params = init_params(config, jax.random.PRNGKey(0))
    # spec_max_batch=2, the fixed rule: every step speculates (the default auto rule would also take
    # plain steps to measure them, and the draft would fall behind elsewhere too)
    eng = Engine(config, params, max_seqs=2, page_size=PAGE, max_tokens_per_step=16, draft=(config, params),
                 num_speculative_tokens=3, spec_max_batch=2)
    prompt = list(range(1, 31)) + list(range(1, 14))
    out = _finish(eng, [prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(prompt) + len(out) == 66 and eng.stats["spec_accepted"] == eng.stats["spec_proposed"] == 15
    _finish(eng, [(prompt + out)[:64] + [5]], SamplingParams(max_tokens=1))
    assert eng.stats["prefix_hits"] == 7 * PAGE
    _no_leaks(eng)


# -- the allocator alone ----------------------------------------------------------------------------
def test_allocator_takes_free_pages_first_then_the_least_recently_used():
    a = PrefixCachingAllocator(7, page_size=2)
    x, y = a.alloc(2), a.alloc(2)
    ix = a.register(x[0], ROOT, [1, 2])
    a.register(x[1], ix, [3, 4])
    a.register(y[0], ROOT, [5, 6])
    a.release(x)
    a.release(y)  # y[1] had no key: free again
    assert a.free == 6 and a.cached == 3
    assert a.alloc(3) and a.cached == 3  # the free pages first: nothing evicted
    assert a.alloc(1) == [x[1]] and a.evictions == 1  # then the tail x[1] (released before x[0])
    assert a.match([1, 2, 3, 4], 2) == ([x[0]], [ix])  # x[0] still cached; its child gone
    assert a.alloc(1) == [y[0]]  # x[0] is held again: the next LRU page goes
    assert a.alloc(1) is None


def test_allocator_keys_are_exact_prefixes():
    a = PrefixCachingAllocator(9, page_size=2)
    p = a.alloc(4)
    i0 = a.register(p[0], ROOT, [1, 2])
    i1 = a.register(p[1], i0, [3, 4])
    assert a.register(p[2], ROOT, [1, 2]) == i0  # the same tokens again: the first page keeps the key
    j = a.register(p[3], ROOT, [9, 9])
    a.release(p)
    assert a.cached == 3 and a.free == 8  # p[2] went back to the free list
    assert a.match([1, 2, 3, 4, 5, 6], 3) == ([p[0], p[1]], [i0, i1])
    assert a.match([9, 9, 3, 4], 2) == ([p[3]], [j])  # [3, 4] after another prefix: a miss
    assert a.match([1, 2, 3, 4], 1) == ([p[0]], [i0])  # max_pages caps the match
    assert a.refs(p[0]) == 2 and a.refs(p[1]) == 1


@pytest.mark.smoke  # the benchmark end to end in a subprocess (~15 s): make test-slow
def test_bench_prefix_quick_smoke(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "prefix.json"
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "scripts.benchmarks.bench_prefix", "--quick", "--rounds", "1",
                        "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    off, on = r["arms"]["no cache"], r["arms"]["prefix cache"]
    assert r["identical"] and off["hit_rate"] == 0 and on["hit_rate"] > 0.5
    assert on["tokens_computed"] < off["tokens_computed"]  # the cache's effect, whatever the machine's load
    assert "| prefix cache |" in out.with_suffix(".md").read_text()
