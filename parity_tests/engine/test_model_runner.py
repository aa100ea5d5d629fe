"""The engine's model runner (model_runner.py) and draft runner (draft_runner.py) on their own, over a
tiny random model. The reference is the model's own uncached forward (``DecoderLM.apply`` over the
whole sequence), which reads no pages: the runners' logits must match it within 1e-5 (float32)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference.draft_runner import DraftRunner, check_draft
from jaxgpt.inference.model_runner import ModelRunner
from jaxgpt.inference.paged_cache import batch_arrays
from jaxgpt.inference.requests import Request
from jaxgpt.inference.sampling import SamplingParams, batch_settings
from jaxgpt.models import init_params
from jaxgpt.models.decoder import DecoderLM

CFG = ModelConfig(vocab_size=48, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_len=32, pos="rope", mlp="swiglu",
                  norm="rmsnorm")
PAGE, PAGES = 4, 8
RUNNER = dict(num_pages=2 * PAGES + 1, page_size=PAGE, kv_dtype="float32", paged_kernel="gather", head_kernel="xla")


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.PRNGKey(0))
    params = jax.tree.map(lambda x: x * 5.0, params)  # unit-scale weights: a wrong key or position shows
    return CFG, params


@functools.partial(jax.jit, static_argnames="config")
def _forward(params, ids, *, config):
    return DecoderLM(config).apply({"params": params}, ids)  # (1, T, V), no cache


def _full_logits(config, params, ids):
    """(T, V) logits of the whole sequence, no cache."""
    return np.asarray(_forward(params, jnp.asarray([ids], jnp.int32), config=config)[0])


def _greedy(config, params, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(_full_logits(config, params, ids)[-1])))
    return ids[-n:]


def test_runner_prefill_then_decode_matches_the_uncached_forward(model):
    config, params = model
    runner = ModelRunner(config, params, **RUNNER)
    prompt, pages = [3, 17, 5, 40, 9, 22], [5, 2, 7]  # pages out of order: the table, not the ids, places them
    tok, logits = runner.forward(*batch_arrays([(prompt, 0, pages)], PAGE, 4, 8, 4))
    want = _full_logits(config, params, prompt)
    np.testing.assert_allclose(np.asarray(logits)[0], want[-1], atol=1e-5, rtol=1e-5)
    assert int(tok[0]) == int(np.argmax(want[-1]))
    seq = prompt + [int(tok[0])]
    for _ in range(3):  # decode steps read the prefill's pages, and their own
        tok, logits = runner.forward(*batch_arrays([([seq[-1]], len(seq) - 1, pages)], PAGE, 4, 1, 4))
        np.testing.assert_allclose(np.asarray(logits)[0], _full_logits(config, params, seq)[-1], atol=1e-5,
                                   rtol=1e-5)
        seq.append(int(tok[0]))


def test_draft_runner_follows_prefill_and_a_self_draft_accepts_its_target(model):
    """A draft that is the target itself proposes the target's greedy tokens: every round accepts all k,
    and emits k + 1 of the target's greedy continuation (the uncached forward's argmax chain)."""
    config, params = model
    k = 2
    target = ModelRunner(config, params, **RUNNER)
    draft = DraftRunner(config, params, target_config=config, max_model_len=32, k=k, budget=8, **RUNNER)
    prompt, pages = [7, 1, 30, 12, 4], [1, 2, 3, 4]
    arrays = batch_arrays([(prompt[:-1], 0, pages)], PAGE, 4, 8, 4)
    target.forward(*arrays)
    draft.follow(*arrays)
    draft.wait()
    table = np.zeros((1, 4), np.int32)
    table[0] = pages
    settings = batch_settings([Request("r", prompt, SamplingParams(temperature=0.0), 0)], 1)
    n, emitted, _ = draft.speculate(target, np.array([prompt[-1]], np.int32), np.array([len(prompt) - 1], np.int32),
                                    table, settings)
    assert int(n[0]) == k
    assert emitted[0].tolist() == _greedy(config, params, prompt, k + 1)


def test_check_draft_names_the_value_and_the_limit():
    small = dataclasses.replace(CFG, max_len=16)
    with pytest.raises(ValueError, match=r"draft's vocabulary \(50\) differs from the target's \(48\)"):
        check_draft(CFG, dataclasses.replace(CFG, vocab_size=50), max_model_len=32, k=2, budget=8)
    with pytest.raises(ValueError, match=r"draft's context \(16\) is shorter than the target's max_model_len \(32\)"):
        check_draft(CFG, small, max_model_len=32, k=2, budget=8)
    with pytest.raises(ValueError, match=r"num_speculative_tokens \+ 1 = 9 tokens of max_tokens_per_step=8"):
        check_draft(CFG, CFG, max_model_len=32, k=8, budget=8)
