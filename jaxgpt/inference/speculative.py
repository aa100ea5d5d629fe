"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model with the
same vocabulary proposes k tokens one by one, the target scores all k + 1 positions in one call,
and the standard accept/reject rule keeps the target's distribution exactly:

    accept draft token x_i with probability min(1, p(x_i) / q(x_i)); at the first rejection
    sample from norm(max(0, p - q)); when all k are accepted, sample one bonus token from p.

Greedy (temperature 0) is the limit where p and q are one-hot: a draft token is accepted iff it
is the target's argmax, so the output is token-identical to the target decoding alone.

Both models keep per-layer KV caches ('rows' layout, ``init_cache(per_layer=True)``); a
rejection rewinds a cache by setting its index back (slots past the index are masked, then
overwritten). One request at a time; the engine batches non-speculative requests.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.models.decoder import DecoderLM, check_tokens, init_cache, unstack_layers


def _probs(logits, temperature):
    """(…, V) float32 -> probabilities; temperature 0 -> one-hot argmax."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(logits / temperature, axis=-1)


def accept_reject(p, q, draft, rng):
    """p (k+1, V) target probabilities, q (k, V) draft probabilities, draft (k,) proposed tokens.
    Returns (n_accepted, next token): the tokens to emit are draft[:n] + [next]."""
    k = draft.shape[0]
    u = jax.random.uniform(jax.random.fold_in(rng, 0), (k,))
    pd = p[jnp.arange(k), draft]
    qd = q[jnp.arange(k), draft]
    ok = u * qd < pd  # u < p/q without dividing by a zero q
    n = jnp.argmin(jnp.concatenate([ok, jnp.zeros(1, bool)]))  # first rejection (k if none)
    resid = jnp.maximum(p[jnp.minimum(n, k - 1)] - q[jnp.minimum(n, k - 1)], 0.0)
    resid = jnp.where(resid.sum() > 0, resid, p[jnp.minimum(n, k - 1)])  # p == q: any residual sample is fine
    dist = jnp.where(n < k, resid, p[k])
    nxt = jax.random.categorical(jax.random.fold_in(rng, 1), jnp.log(dist))
    return n, nxt.astype(jnp.int32)


def _rewind(cache, index):
    return tuple(c.replace(index=jnp.asarray(index, jnp.int32)) for c in cache)


@partial(jax.jit, static_argnames=("config",))
def _forward(params, tokens, cache, *, config):
    out = DecoderLM(config).apply({"params": params}, tokens, cache=cache)
    return out.logits, out.cache


@partial(jax.jit, static_argnames=("config", "k", "temperature"))
def _propose(params, last, cache, rng, *, config, k, temperature):
    """k draft tokens from ``last`` (1,), one decode step each -> (tokens (k,), q (k, V), cache)."""
    toks, qs = [], []
    tok = last
    for i in range(k):
        out = DecoderLM(config).apply({"params": params}, tok[None], cache=cache)
        cache = out.cache
        q = _probs(out.logits[0, -1], temperature)
        tok = (jnp.argmax(q)[None] if temperature == 0
               else jax.random.categorical(jax.random.fold_in(rng, i), jnp.log(q))[None]).astype(jnp.int32)
        toks.append(tok[0])
        qs.append(q)
    # feed the k-th proposal too, so that when all k are accepted the draft's cache already holds it
    cache = DecoderLM(config).apply({"params": params}, tok[None], cache=cache).cache
    return jnp.stack(toks), jnp.stack(qs), cache


def speculative_generate(target_config, target_params, draft_config, draft_params, prompt, max_new_tokens: int, *,
                         k: int = 4, temperature: float = 0.0, rng=None, stats: dict | None = None):
    """Continue ``prompt`` (T0,) ids by ``max_new_tokens`` tokens with a draft proposing ``k`` at a
    time. Returns the new tokens (list); ``stats`` (a dict) gets 'proposed' and 'accepted' counts."""
    if target_config.vocab_size != draft_config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_config.vocab_size}) differs from the target's "
                         f"({target_config.vocab_size}); speculative decoding needs the same one")
    if k < 1:
        raise ValueError(f"k (proposed tokens) must be >= 1, got {k}")
    prompt = np.asarray(prompt, np.int32).reshape(1, -1)
    t0 = prompt.shape[1]
    room = min(target_config.max_len, draft_config.max_len)
    if t0 + max_new_tokens + k > room:
        raise ValueError(f"{t0} prompt + {max_new_tokens} new + {k} proposed tokens exceed the context ({room})")
    check_tokens(prompt, target_config.vocab_size, room)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    tc, tp = unstack_layers(target_config, target_params)
    dc, dp = unstack_layers(draft_config, draft_params)
    tp, dp = jax.device_put((tp, dp))  # once: host (NumPy) params would be copied into every call
    cap = t0 + max_new_tokens + k
    tcache = init_cache(tc, 1, cap, per_layer=True)
    dcache = init_cache(dc, 1, cap, per_layer=True)
    # Both prefill all but the last prompt token; every round then starts from one pending token.
    if t0 > 1:
        _, tcache = _forward(tp, jnp.asarray(prompt[:, :-1]), tcache, config=tc)
        _, dcache = _forward(dp, jnp.asarray(prompt[:, :-1]), dcache, config=dc)
    pos = t0 - 1  # cached positions in both models
    last = int(prompt[0, -1])
    out: list[int] = []
    stats = {} if stats is None else stats
    stats.setdefault("proposed", 0)
    stats.setdefault("accepted", 0)
    step = 0
    while len(out) < max_new_tokens:
        key = jax.random.fold_in(rng, step)
        step += 1
        draft, q, dcache = _propose(dp, jnp.asarray([last], jnp.int32), dcache, jax.random.fold_in(key, 0),
                                    config=dc, k=k, temperature=float(temperature))
        verify = jnp.concatenate([jnp.asarray([last], jnp.int32), draft])[None]  # (1, k+1)
        logits, tcache = _forward(tp, verify, tcache, config=tc)
        p = _probs(logits[0], temperature)
        n, nxt = accept_reject(p, q, draft, jax.random.fold_in(key, 1))
        n, nxt = int(n), int(nxt)
        stats["proposed"] += k
        stats["accepted"] += n
        new = [int(t) for t in np.asarray(draft[:n])] + [nxt]
        out += new
        pos += n + 1  # `last` and the n accepted drafts are now cached (target); rewind both to there
        tcache, dcache = _rewind(tcache, pos), _rewind(dcache, pos)
        last = nxt
    return out[:max_new_tokens]
