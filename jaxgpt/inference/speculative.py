"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model with the
same vocabulary proposes k tokens one by one, the target scores all k + 1 positions in one call,
and the standard accept/reject rule keeps the target's distribution exactly:

    accept draft token x_i with probability min(1, p(x_i) / q(x_i)); at the first rejection
    sample from norm(max(0, p - q)); when all k are accepted, sample one bonus token from p.

Greedy (temperature 0) is the limit where p and q are one-hot: a draft token is accepted iff it
is the target's argmax, so the output is token-identical to the target decoding alone.

``speculate`` is the one implementation: a batched round over the paged pools of both models
(which share each request's page ids), in one program. Every decoding row proposes (``propose``)
and is verified (``verify``); a rejection needs no rewind, since positions are explicit and the
next round overwrites the slots past the accepted ones. The engine runs it (``Engine(draft=...)``,
``jaxgpt serve --draft``); ``speculative_generate`` drives it for one request from the host.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.inference.paged_cache import init_pools, next_pow2, resolve_paged_kernel
from jaxgpt.inference.paged_model import paged_apply, paged_forward
from jaxgpt.inference.sampling import argmax, filter_logits, row_keys
from jaxgpt.models.decoder import unstack_layers
from jaxgpt.models.stack import check_tokens


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


def speculative_generate(target_config, target_params, draft_config, draft_params, prompt, max_new_tokens: int, *,
                         k: int = 4, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                         page_size: int = 16, stats: dict | None = None):
    """Continue ``prompt`` (T0,) ids by ``max_new_tokens`` tokens with a draft proposing ``k`` at a
    time, one request, rounds driven from the host. Each round is the engine's own program
    (``speculate``, batch 1) over paged pools of one request's pages, so offline and served
    speculative decoding are one implementation. Sampling as ``SamplingParams``: ``temperature``
    (0: greedy), ``top_k``, ``top_p``, ``seed``. Returns the new tokens (list); ``stats`` (a dict)
    gets 'proposed' and 'accepted' counts."""
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
    tc, dc = target_config, draft_config
    _, tp = unstack_layers(tc, target_params)
    _, dp = unstack_layers(dc, draft_params)
    tp, dp = jax.device_put((tp, dp))  # once: host (NumPy) params would be copied into every call
    # Pages 1..n hold the request in order (page 0 is the scratch page padding writes go to); a power
    # of two of them, so prompts of nearby lengths share the compiled programs.
    pages = next_pow2(-(-(t0 + max_new_tokens + k) // page_size))
    table = np.arange(1, pages + 1, dtype=np.int32)[None]  # (1, P)
    pools, dpools = init_pools(tc, pages + 1, page_size), init_pools(dc, pages + 1, page_size)
    kernels = [resolve_paged_kernel("auto", c.dtype, pl[0][0].dtype, c.head_dim, page_size, c.attn_softcap)
               for c, pl in ((tc, pools), (dc, dpools))]
    # Both prefill all but the last prompt token; every round then starts from one pending token.
    if t0 > 1:
        q_pos = np.arange(t0 - 1, dtype=np.int32)[None]  # (1, T0 - 1)
        pools = paged_forward(tp, pools, prompt[:, :-1], q_pos, None, table, config=tc, kernel=kernels[0])[0]
        dpools = paged_forward(dp, dpools, prompt[:, :-1], q_pos, None, table, config=dc, kernel=kernels[1])[0]
    settings = (np.array([temperature], np.float32), np.array([top_k], np.int32), np.array([top_p], np.float32),
                np.array([seed], np.uint32))
    pos, last, out = t0 - 1, int(prompt[0, -1]), []  # pos: positions cached in both models
    stats = {} if stats is None else stats
    stats.setdefault("proposed", 0)
    stats.setdefault("accepted", 0)
    while len(out) < max_new_tokens:
        pools, dpools, n, emitted, _ = speculate(tp, pools, dp, dpools, np.array([last], np.int32),
                                                 np.array([pos], np.int32), table, *settings,
                                                 np.array([len(out)], np.int32), config=tc, draft_config=dc, k=k,
                                                 kernel=kernels[0], draft_kernel=kernels[1])
        n = int(n[0])
        stats["proposed"] += k
        stats["accepted"] += n
        out += np.asarray(emitted[0, :n + 1]).tolist()
        pos += n + 1  # `last` and the n accepted drafts are now cached; the next round overwrites the rest
        last = out[-1]
    return out[:max_new_tokens]


# -- batched, over the engine's paged pools --------------------------------------------------------
def supports(params) -> bool:
    """Whether the batched round honours a request's SamplingParams. Bias, penalties (which change
    with each accepted draft) and top-logprobs are not in it: the engine decodes such a request
    plainly instead, never ignoring them."""
    return not (params.adjusts_logits or params.top_logprobs)


def _row_probs(logits, temperature, top_k, top_p):
    """(B, V) -> each row's sampling distribution (its temperature, top-k, top-p; one-hot argmax
    for greedy rows): the distribution a token is drawn from, so the rule compares the right p, q."""
    probs = jax.nn.softmax(filter_logits(logits, temperature, top_k, top_p), axis=-1)
    onehot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], probs, onehot)


def _keys(seeds, counters, salt: int):
    """A row's keys for one round: fold_in(fold_in(PRNGKey(seed), tokens out), salt); the salt
    keeps the draft's draws and the rule's apart from each other and from plain sampling's."""
    return jax.vmap(lambda key: jax.random.fold_in(key, salt))(row_keys(seeds, counters))


def propose(params, pools, last, pos, page_table, temperature, top_k, top_p, seeds, counters, head=None, *, config, k,
            kernel):
    """The draft's k proposals for every row, one decode step each: ``last`` (B,) pending tokens
    at positions ``pos`` (B,) (-1: padding row) -> (pools, draft (B, k), q (B, k, V) the
    distributions they were drawn from; zeros when no row samples, since greedy rows need none).
    A (k+1)-th step writes the k-th proposal's keys and values, so that when all k are accepted
    the draft's cache already holds them."""
    keys = _keys(seeds, counters, 1)
    sampled = jnp.any(temperature > 0)
    tok, toks, qs = last, [], []
    for i in range(k + 1):
        p = jnp.where(pos >= 0, pos + i, -1)[:, None]  # (B, 1)
        pools, top, logits = paged_apply(params, pools, tok[:, None], p, None, page_table, head=head, config=config,
                                         kernel=kernel)
        if i == k:
            break
        logits = logits[:, 0]  # (B, V)

        def draw(logits=logits, i=i):
            q = _row_probs(logits, temperature, top_k, top_p)
            keys_i = jax.vmap(lambda key: jax.random.fold_in(key, i))(keys)
            return q, jax.vmap(jax.random.categorical)(keys_i, jnp.log(q)).astype(jnp.int32)

        # the sort and draws only when a row samples: a greedy batch skips them (vocabulary-sized work)
        q, drawn = jax.lax.cond(sampled, draw, lambda: (jnp.zeros_like(logits), jnp.zeros(last.shape, jnp.int32)))  # noqa: B023 - called in this iteration
        tok = jnp.where(temperature > 0, drawn, top[:, 0])
        toks.append(tok)
        qs.append(q)
    return pools, jnp.stack(toks, 1), jnp.stack(qs, 1)


def verify(params, pools, last, pos, page_table, draft, q, temperature, top_k, top_p, seeds, counters, head=None, *,
           config, kernel):
    """The target scores [last, draft] (B, k+1) in one call and each row takes the rule ->
    (pools, n accepted (B,), emitted (B, k+1): draft[:n], then the next token at column n,
    their log-probabilities under the target (B, k+1)). Greedy rows take the target's argmax
    chain itself (the rule's one-hot limit, without a draw), so they match decoding it alone."""
    b, k = draft.shape
    q_pos = jnp.where(pos[:, None] >= 0, pos[:, None] + jnp.arange(k + 1)[None], -1)  # (B, k+1)
    tokens = jnp.concatenate([last[:, None], draft], axis=1)
    pools, top, logits = paged_apply(params, pools, tokens, q_pos, None, page_table, head=head, config=config,
                                     kernel=kernel)  # (B, k+1), (B, k+1, V)
    v = logits.shape[-1]

    def rule():
        rep = lambda x: jnp.repeat(x, k + 1)  # per-row settings for each of its k+1 positions
        p = _row_probs(logits.reshape(-1, v), rep(temperature), rep(top_k), rep(top_p)).reshape(b, k + 1, v)
        return jax.vmap(accept_reject)(p, q, draft, _keys(seeds, counters, 2))

    zeros = jnp.zeros((b,), jnp.int32)
    n, nxt = jax.lax.cond(jnp.any(temperature > 0), rule, lambda: (zeros, zeros))
    gn = jnp.argmin(jnp.concatenate([draft == top[:, :k], jnp.zeros((b, 1), bool)], axis=1), axis=1)
    greedy = temperature == 0
    n = jnp.where(greedy, gn, n).astype(jnp.int32)
    nxt = jnp.where(greedy, jnp.take_along_axis(top, gn[:, None], axis=1)[:, 0], nxt)
    emitted = jnp.concatenate([draft, zeros[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None] == n[:, None], nxt[:, None], emitted)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), emitted[..., None], axis=-1)[..., 0]
    return pools, n, emitted, logp


@partial(jax.jit, static_argnames=("config", "draft_config", "k", "kernel", "draft_kernel"), donate_argnums=(1, 3))
def speculate(params, pools, draft_params, draft_pools, last, pos, page_table, temperature, top_k, top_p, seeds,
              counters, head=None, draft_head=None, *, config, draft_config, k, kernel="gather", draft_kernel="gather"):
    """One speculative round for a batch, in one program (the engine's): the draft proposes k
    tokens a row (``propose``), the target verifies them (``verify``). Both pools are donated.
    ``head``, ``draft_head``: packed vocabulary projections (packed_head.py) or None.
    -> (pools, draft_pools, n accepted (B,), emitted (B, k+1), log-probabilities (B, k+1))."""
    settings = (temperature, top_k, top_p, seeds, counters)
    draft_pools, draft, q = propose(draft_params, draft_pools, last, pos, page_table, *settings, draft_head,
                                    config=draft_config, k=k, kernel=draft_kernel)
    pools, n, emitted, logp = verify(params, pools, last, pos, page_table, draft, q, *settings, head, config=config,
                                     kernel=kernel)
    return pools, draft_pools, n, emitted, logp
