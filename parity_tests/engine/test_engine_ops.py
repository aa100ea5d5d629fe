"""The engine's serving limits: ``max_model_len`` (a shorter context than the model's) and stop
strings checked incrementally (jaxgpt/inference/engine.py with detokenize.Detokenizer).

References: transformers' greedy ``generate`` (test_engine.py's module fixtures) for the tokens,
and for stop strings a brute-force scan of every prefix's full decode (the first token after which
the decoded output contains a stop string), computed here without the Detokenizer. The KV budget
against the bytes of the pools ``init_pools`` allocates.
"""
from __future__ import annotations

import pytest

from jaxgpt.inference.engine import Engine
from jaxgpt.inference.paged_cache import (device_memory_bytes, init_pools, page_bytes, pages_for_budget,
                                         parse_budget, pool_bytes)
from jaxgpt.inference.requests import Request
from jaxgpt.inference.sampling import SamplingParams
from test_engine import _hf_greedy, llama  # noqa: F401  (the module fixture: HF LLaMA and its jaxgpt params)


def test_max_model_len_bounds_pages_prompts_and_outputs(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    model, config, params = llama
    eng = Engine(config, params, max_seqs=2, page_size=8, max_model_len=20)
    assert eng.max_model_len == 20 and eng.max_pages_per_seq == 3  # ceil(20 / 8)
    assert eng.allocator.total == 2 * 3  # the default pool: max_seqs contexts of max_model_len
    prompt = [5, 6, 7, 8, 9]
    out = eng.generate([prompt], [SamplingParams(max_tokens=100)])[0]
    assert out == _hf_greedy(model, prompt, 15)  # 20 - 5 tokens, then "length"
    rid = eng.add_request(prompt, SamplingParams(max_tokens=100))
    last = None
    while eng.has_unfinished():
        last = [o for o in eng.step() if o.id == rid] or last
    assert last[-1].finish_reason == "length" and eng.allocator.free == eng.allocator.total
    assert (eng.stats["prompt_tokens"], eng.stats["generated_tokens"]) == (2 * 5, 2 * 15)
    with pytest.raises(ValueError, match="the prompt has 20 tokens; the context window is 20"):
        eng.add_request([3] * 20)
    with pytest.raises(ValueError, match=r"max_model_len=65 must be in \[2, 64\]"):
        Engine(config, params, max_model_len=65)
    with pytest.raises(ValueError, match="num_pages=3 cannot hold one full context \\(20 tokens = 3 pages of 8"):
        Engine(config, params, page_size=8, max_model_len=20, num_pages=3)


def _decode(ids):
    """A text for every id: two letters, so a stop string may begin mid-token."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[i % 26] + "xyz"[i % 3] for i in ids)


class _Counting:
    def __init__(self):
        self.ids = 0

    def __call__(self, ids):
        self.ids += len(ids)
        return _decode(ids)


def test_stop_strings_in_the_engine_are_incremental(llama):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    model, config, params = llama
    prompt, n = [4, 9, 16, 25], 40
    greedy = _hf_greedy(model, prompt, n)
    full = _decode(greedy)
    counting = _Counting()
    eng = Engine(config, params, max_seqs=2, page_size=8, decode=counting)
    cases = [full[9:12], full[20:21], "never"]  # across a token boundary (odd start), one character, none
    for stop in cases:
        want = next((greedy[:i] for i in range(1, n + 1) if stop in _decode(greedy[:i])), greedy)
        counting.ids = 0
        got = eng.generate([prompt], [SamplingParams(max_tokens=n, stop=(stop, "zzzz"))])[0]
        assert got == want, stop
        assert counting.ids <= 8 * len(got), counting.ids  # a window a token; a full decode would be ~n^2 / 2
        assert not eng._stops and eng.allocator.free == eng.allocator.total
    eng.decode = None
    with pytest.raises(ValueError, match="stop strings need the engine's decode function"):
        eng._finish_reason(Request("r", [1], SamplingParams(stop=("a",)), 0, output=[3]), 3)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_kv_budget_counts_the_pools_init_pools_allocates(llama, kv_dtype):  # noqa: F811 - a pytest fixture argument named as the imported fixture
    """The reference is the pools themselves: init_pools' arrays' nbytes, target and draft."""
    _, config, _ = llama
    draft = config.replace(n_layer=1)
    for dcfg in (None, draft):
        per_page = pool_bytes(init_pools(config, 2, 8, kv_dtype)) // 2
        if dcfg is not None:
            per_page += pool_bytes(init_pools(dcfg, 2, 8, kv_dtype)) // 2
        assert page_bytes(config, 8, kv_dtype) + (page_bytes(dcfg, 8, kv_dtype) if dcfg else 0) == per_page
        budget = 50 * per_page + per_page // 2
        n = pages_for_budget(config, 8, kv_dtype, budget, draft_config=dcfg)
        assert n == 50
        with pytest.raises(ValueError, match=r"holds 8 pages of .*one full context of 64 tokens needs 9 pages"):
            pages_for_budget(config, 8, kv_dtype, 8 * per_page + 1, draft_config=dcfg)
        assert pages_for_budget(config, 8, kv_dtype, 4 * per_page, max_model_len=24, draft_config=dcfg) == 4


def test_parse_budget_sizes_and_fractions():
    total = device_memory_bytes()
    assert total > 2 ** 20
    assert parse_budget("4GiB") == 4 * 2 ** 30 and parse_budget("512 MiB") == 512 * 2 ** 20
    assert parse_budget("1.5GB") == 1_500_000_000 and parse_budget(123456) == 123456
    assert parse_budget("0.25") == parse_budget(0.25) == int(0.25 * total)
    for bad, msg in (("4 parsecs", "neither a size"), ("lots", "neither a size"), ("3", r"must be in \(0, 1\]"),
                     (0.0, r"must be in \(0, 1\]"), (-5, "positive number of bytes"), (True, "positive number")):
        with pytest.raises(ValueError, match=msg):
            parse_budget(bad)
