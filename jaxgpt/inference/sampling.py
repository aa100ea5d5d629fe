"""Per-request sampling for the engine: each row of a batch has its own temperature, top-k,
top-p, penalties, logit bias and PRNG key. A row's key is fold_in(PRNGKey(seed), n) for its n-th
output token, so what a request samples depends on its own seed and progress, never on its batch
companions.

Order (OpenAI's and vLLM's): the model's logits, plus each row's ``logit_bias``, minus its presence
and frequency penalties on the tokens it has output so far; then greedy rows take the argmax, and
sampling rows apply temperature, top-k, top-p and draw. Log-probabilities (the chosen token's and
the ``top_logprobs`` alternatives) are vLLM v1's default ``raw_logprobs``: the log-softmax of the
model's own logits, before bias, penalties, temperature, top-k and top-p.
"""
from __future__ import annotations

import numbers
import operator
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import check_sampling
from jaxgpt.nn.kernels.panel_ffi import argmax

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the one static top-k the sampling program compiles besides 0
MAX_PENALTY, MAX_BIAS = 2.0, 100.0  # OpenAI's ranges: penalties in [-2, 2], a bias in [-100, 100]


def fresh_seed() -> int:
    """A new seed in [0, 2**32) from the OS's entropy: what an unseeded sampling call draws, in the
    engine, the server and ``generate`` alike (OpenAI's behaviour: unseeded samples differ)."""
    return secrets.randbits(32)


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. The defaults are greedy (temperature 0) for 16 tokens; top_k 0 and
    top_p 1.0 switch those off.

    ``seed``: the request's PRNG seed in [0, 2**32); None draws a fresh one when the engine takes
    the request (recorded as ``Request.seed``), so two unseeded sampling requests differ and a
    seeded one repeats, whatever else is in its batch.
    ``presence_penalty``, ``frequency_penalty`` in [-2, 2] and ``logit_bias`` ((token id, bias)
    pairs or a dict, bias in [-100, 100]): logits[t] += bias[t] - presence * (count[t] > 0)
    - frequency * count[t], where count[t] counts t among the request's output tokens so far;
    greedy rows too (a -100 bias bans a token).
    ``logprobs``: return each chosen token's log-probability; ``top_logprobs`` (0 to 20, needs
    logprobs): also that many alternatives a token, most likely first, from the same
    distribution: the model's log-softmax before bias, penalties and temperature (vLLM's default).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (need the engine's decode function)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_sampling(self.temperature, self.top_k or None, self.top_p)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, numbers.Integral) and 0 <= self.seed < 2 ** 32):
            raise ValueError(f"seed must be in [0, 2**32) or None (a fresh one), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _check_bias(self.logit_bias))

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request's logits get a bias or penalties (the engine's costlier sampling variant)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


def _check_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as given (a dict or (id, bias) pairs) -> sorted (id, bias) pairs, or a ValueError
    naming the bad entry. Ids are checked against the vocabulary by the engine, which knows it."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else [tuple(p) for p in bias]
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        tok, b = pair
        try:
            tok = operator.index(tok)
        except TypeError:
            raise ValueError(f"logit_bias token ids must be integers, got {tok!r}") from None
        if tok < 0:
            raise ValueError(f"logit_bias token id {tok} is negative")
        if tok in out:
            raise ValueError(f"logit_bias names token id {tok} twice")
        if not isinstance(b, numbers.Real) or not -MAX_BIAS <= b <= MAX_BIAS:  # NaN fails too
            raise ValueError(f"logit_bias[{tok}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}")
        out[tok] = float(b)
    return tuple(sorted(out.items()))


def filter_logits(logits, temperature, top_k, top_p):
    """logits (B, V) float32 -> each row's sampling logits: divided by its temperature, with the
    tokens outside its top-k and top-p sets at float32's minimum (probability 0 after softmax).
    Rows with temperature 0 are divided by 1 (callers take their argmax instead)."""
    v = logits.shape[-1]
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    srt = jnp.sort(x, axis=-1)[:, ::-1]  # (B, V) descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # (B, 1)
    neg = jnp.finfo(jnp.float32).min
    x = jnp.where(x < kth, neg, x)
    srt = jnp.where(jnp.arange(v)[None] < k[:, None], srt, neg)
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
    keep = before < top_p[:, None]  # the token crossing p is kept, so one always survives
    cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < cutoff, neg, x)


def row_keys(seeds, counters):
    """(B,) seeds and output counters -> (B,) PRNG keys: fold_in(PRNGKey(seed), counter)."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)


def _sample_rows(logits, temperature, top_k, top_p, seeds, counters):
    """logits (B, V) float32 -> tokens (B,) by each row's own settings (temperature > 0 rows)."""
    x = filter_logits(logits, temperature, top_k, top_p)
    keys = row_keys(seeds, counters)
    return jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, x).astype(jnp.int32)


def adjust_logits(logits, adjust):
    """logits (B, V) + adjust = (ids (B, K), values (B, K)) -> logits with each row's values added
    at its ids. A row's ids are distinct (padding: id 0, value 0.0, which adds nothing)."""
    ids, values = adjust
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].add(values)


def select_tokens(logits, temperature, top_k, top_p, seeds, counters, want_logprobs=True, adjust=None):
    """Next token and its log-probability under the model (B,), (B,): greedy rows take the argmax;
    the sort and draw run only when some row samples, the log-probabilities only when asked for
    (zeros otherwise). ``adjust`` (see ``adjust_logits``: bias and penalties) shifts the logits
    both take, greedy or sampled; the log-probability is the model's own (before it)."""
    logits = logits.astype(jnp.float32)
    x = logits if adjust is None else adjust_logits(logits, adjust)
    greedy = argmax(x)
    tok = jax.lax.cond(jnp.any(temperature > 0),
                       lambda: jnp.where(temperature > 0, _sample_rows(x, temperature, top_k, top_p, seeds,
                                                                       counters), greedy),
                       lambda: greedy)
    logp = jax.lax.cond(jnp.asarray(want_logprobs),
                        lambda: jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
                        - jax.nn.logsumexp(logits, axis=-1),
                        lambda: jnp.zeros(tok.shape, jnp.float32))
    return tok, logp


def top_logprobs(logits, n: int):
    """logits (B, V) -> the n most likely tokens (B, n) int32 and their log-probabilities (B, n),
    most likely first (ties: the lower id first), from the model's log-softmax."""
    logits = logits.astype(jnp.float32)
    if n == 0:
        return jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    vals, ids = jax.lax.top_k(logits, n)  # the log-softmax's order is the logits' order
    return ids.astype(jnp.int32), vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


@partial(jax.jit, static_argnames=("n_top",))
def sample(logits, temperature, top_k, top_p, seeds, counters, want_logprobs, adjust=None, n_top=0):
    """The engine's sampling program: (B, V) logits and per-row settings (B,) -> tokens (B,),
    logprobs (B,), top ids (B, n_top), top logprobs (B, n_top). ``adjust`` None and ``n_top`` 0
    compile the plain variant; bias/penalties and top-logprobs are separate variants, compiled
    only when some row in a call asks for them."""
    tok, logp = select_tokens(logits, temperature, top_k, top_p, seeds, counters, want_logprobs, adjust)
    return (tok, logp, *top_logprobs(logits, n_top))


# -- host side: a batch of requests (``Request``: params, seed, output, adjust) -> sample's inputs ------
def batch_settings(reqs, b: int):
    """Per-row sampling arrays (B,) for ``sample``: temperature, top_k, top_p, seed, output counter
    (the padding rows after ``reqs``: greedy, seed 0)."""
    pad = b - len(reqs)
    sp = [r.params for r in reqs] + [SamplingParams()] * pad
    return (np.array([s.temperature for s in sp], np.float32), np.array([s.top_k for s in sp], np.int32),
            np.array([s.top_p for s in sp], np.float32), np.array([r.seed for r in reqs] + [0] * pad, np.uint32),
            np.array([len(r.output) for r in reqs] + [0] * pad, np.int32))


def batch_adjust(reqs, b: int, vocab_size: int):
    """Each row's bias and penalties as (ids (B, K), values (B, K)) for ``sample``, from
    ``Request.adjust`` (kept up to date a token at a time by the engine); None when no row has any
    (the plain variant). Sparse, because its cost follows the tokens a row names, not the
    vocabulary: a dense (B, V) bias is (B, V) floats to fill and copy every step (docs/performance.md),
    and a host-to-device copy of that size on an accelerator. K is a power of two of
    at least 16, so at most log2(V / 16) variants compile, each on first use."""
    k = max((len(r.adjust) for r in reqs), default=0)
    if k == 0:
        return None
    k = min(max(1 << (k - 1).bit_length(), 16), 1 << (vocab_size - 1).bit_length())
    ids, vals = np.zeros((b, k), np.int32), np.zeros((b, k), np.float32)  # padding adds 0.0 to token 0
    for i, r in enumerate(reqs):
        n = len(r.adjust)
        ids[i, :n] = np.fromiter(r.adjust.keys(), np.int32, n)
        vals[i, :n] = np.fromiter(r.adjust.values(), np.float32, n)
    return ids, vals


def sample_requests(logits, reqs, b: int, vocab_size: int):
    """Run ``sample`` on logits (B, V) for requests (the first rows) -> tokens (B,), logprobs (B,)
    numpy, and each request's top logprobs: a list of its ``top_logprobs`` (id, logprob) pairs."""
    want = any(r.params.logprobs for r in reqs)
    n_top = MAX_TOP_LOGPROBS if any(r.params.top_logprobs for r in reqs) else 0
    tok, logp, top_ids, top_lp = sample(logits, *batch_settings(reqs, b), np.bool_(want),
                                        batch_adjust(reqs, b, vocab_size), n_top=n_top)
    top_ids, top_lp = np.asarray(top_ids), np.asarray(top_lp)
    tops = [list(zip(top_ids[i, :r.params.top_logprobs].tolist(), top_lp[i, :r.params.top_logprobs].tolist()))
            for i, r in enumerate(reqs)]
    return np.asarray(tok), np.asarray(logp), tops
