"""The engine's Scheduler on its own (scheduler.py): requests, pages, admission, preemption and each
step's plan of rows, with no model. Expectations are worked out by hand from the page arithmetic."""
from __future__ import annotations

import pytest

from jaxgpt.inference.sampling import SamplingParams
from jaxgpt.inference.scheduler import Scheduler


def _sched(**kw) -> Scheduler:
    args = dict(vocab=32, max_model_len=64, max_seqs=4, page_size=4, num_pages=9, budget=16, prefix_caching=False,
                k=None, spec_max_batch="auto")
    return Scheduler(**(args | kw))


def test_admits_plans_decode_and_prefill_rows_and_frees_pages():
    s = _sched()
    a = s.add_request(list(range(1, 7)))  # 6 tokens: 2 pages
    b = s.add_request(list(range(1, 4)))  # 3 tokens: 1 page
    s.admit()
    assert [r.id for r in s.running] == [a, b]
    spec, decode, prefill = s.schedule()
    assert spec == [] and decode == [] and [(r.id, n) for r, n in prefill] == [(a, 6), (b, 3)]
    assert s.allocator.free == s.allocator.total - 3
    for r, n in prefill:  # the runner computed them and sampled one token each
        r.computed += n
        r.output.append(7)
    _, decode, prefill = s.schedule()
    assert [(r.id, n) for r, n in decode] == [(a, 1), (b, 1)] and prefill == []
    assert len(s.requests[a].pages) == 2 and len(s.requests[b].pages) == 1  # 7 and 4 tokens
    s.finish(s.requests[a])
    assert a not in s.requests and [r.id for r in s.running] == [b]
    assert s.allocator.free == s.allocator.total - 1
    assert s.abort(b) and not s.has_unfinished() and s.allocator.free == s.allocator.total


def test_preempts_the_latest_admitted_when_pages_run_out():
    s = _sched(num_pages=5, budget=32)  # 4 allocatable pages (page 0 is the scratch page)
    first, second = s.add_request([1] * 7), s.add_request([2] * 4)  # 2 pages + 1 page
    s.admit()
    _, _, prefill = s.schedule()
    for r, n in prefill:
        r.computed += n
        r.output.append(3)
    # first now needs its 3rd page at token 9 after one more; second holds its one page full
    s.requests[first].output += [3]  # 9 tokens: the next decode writes position 8, a third page
    s.requests[first].computed += 1
    s.requests[second].output += [3] * 4  # 9 tokens: its next write needs a third page too
    s.requests[second].computed += 4
    _, decode, _ = s.schedule()
    assert [r.id for r, _ in decode] == [first] and s.stats["preemptions"] == 1
    assert [r.id for r in s.waiting] == [second] and s.requests[second].pages == []
    assert s.requests[second].computed == 0  # recomputed from its prompt and outputs later


def test_spec_counters_are_the_schedulers_own():
    """With a draft (k) and a fixed spec_max_batch, a step whose batch is over it counts spec_off_steps,
    a key the scheduler itself creates."""
    s = _sched(k=2, spec_max_batch=1)
    assert s.stats["spec_off_steps"] == 0 and "spec_off_steps" not in _sched().stats
    ids = [s.add_request([1, 2], SamplingParams(max_tokens=4)) for _ in range(2)]
    s.admit()
    for r, n in s.schedule()[2]:
        r.computed += n
        r.output.append(5)
    spec, decode, _ = s.schedule()  # two running > spec_max_batch=1: plain decode steps
    assert spec == [] and [r.id for r, _ in decode] == ids and s.stats["spec_off_steps"] == 1
    assert set(s.draft_at) == set(ids)  # the draft's pages fall behind from here


def test_shapes_are_buckets_and_buckets_cover_them():
    s = _sched(max_seqs=3)
    assert s.shape("decode", 3, 1, 5) == ("decode", 4, 1, 8)  # rows and pages: powers of two, at least 4
    assert s.shape("prefill", 1, 9, 1) == ("prefill", 4, 16, 4)
    assert s.shape("spec", 1, 3, 1)[1] == 1  # speculative rows start at 1
    buckets = s.buckets()
    assert s.shape("decode", 3, 1, 5) in buckets and all(kind != "spec" for kind, *_ in buckets)
    assert {kind for kind, *_ in _sched(k=2).buckets()} == {"decode", "prefill", "spec"}


def test_refuses_bad_requests_by_name():
    s = _sched(max_model_len=8)
    with pytest.raises(ValueError, match=r"token id 40 is outside the vocabulary \[0, 32\)"):
        s.add_request([1, 40])
    with pytest.raises(ValueError, match="the prompt has 8 tokens; the context window is 8"):
        s.add_request([1] * 8)
