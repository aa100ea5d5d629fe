"""Speculative decoding (jaxgpt/inference/speculative.py).

Greedy: token-identical to jaxgpt's generate() with the target alone (a reference whose parity
with torch_ref is test_generate.py's). Sampling: the accept/reject rule's first emitted token is
distributed as the target's p, whatever the draft's q (20000 draws on a 4-token vocabulary;
each frequency within 4 standard errors of p, a distribution the test sets itself).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference.generate import generate
from jaxgpt.inference.speculative import accept_reject, speculative_generate
from jaxgpt.models import init_params

TARGET = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_len=64, pos="rope")
DRAFT = ModelConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, max_len=64, pos="rope")


@functools.cache
def _params(cfg, seed):
    return init_params(cfg, jax.random.PRNGKey(seed))


@pytest.mark.slow  # two models, draft and verify programs for each: ~6 compilations
def test_greedy_identical_to_target_alone():
    prompt = np.array([3, 14, 15, 9, 2, 6], np.int32)
    want = np.asarray(generate(TARGET, _params(TARGET, 0), prompt[None], 20))[0, len(prompt):].tolist()
    stats = {}
    got = speculative_generate(TARGET, _params(TARGET, 0), DRAFT, _params(DRAFT, 1), prompt, 20, k=3, stats=stats)
    assert got == want
    assert stats["proposed"] > 0
    same = {}
    assert speculative_generate(TARGET, _params(TARGET, 0), TARGET, _params(TARGET, 0), prompt, 20, k=3,
                                stats=same) == want
    assert same["accepted"] == same["proposed"]  # a draft identical to the target is always accepted
    # Sampling (self-consistency): a seed repeats its tokens, another seed draws others.
    draw = lambda seed: speculative_generate(TARGET, _params(TARGET, 0), DRAFT, _params(DRAFT, 1), prompt, 20, k=3,
                                             temperature=1.0, top_k=20, seed=seed)
    assert draw(1) == draw(1) != draw(2)


def test_accept_reject_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    v, k, n = 4, 2, 20000
    p = rng.dirichlet(np.ones(v), k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v), k).astype(np.float32)

    def first_token(key):
        kd, ka = jax.random.split(key)
        draft = jax.random.categorical(kd, jnp.log(jnp.asarray(q)), axis=-1).astype(jnp.int32)  # x_i ~ q_i
        m, nxt = accept_reject(jnp.asarray(p), jnp.asarray(q), draft, ka)
        return jnp.where(m > 0, draft[0], nxt)

    toks = jax.jit(jax.vmap(first_token))(jax.random.split(jax.random.PRNGKey(0), n))
    freq = np.bincount(np.asarray(toks), minlength=v) / n
    se = np.sqrt(p[0] * (1 - p[0]) / n)
    assert np.all(np.abs(freq - p[0]) <= 4 * se), (freq, p[0])
    assert np.any(np.abs(freq - q[0]) > 4 * se)  # the draft's own distribution would be told apart
