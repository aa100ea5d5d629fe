"""Sampling (pure) and compiled autoregressive decoding for DecoderLM.

Cached decoding: one prefill call writes the prompt's keys/values into a preallocated cache
(one 'rows' KVCache per layer), then a ``lax.while_loop`` feeds one token per step at fixed
shapes, so the whole generation is one compiled program whatever the number of tokens. Uncached
decoding recomputes a fixed (B, max_len) window every step (the reference the cache is tested
against, and the fallback that crops to the context window when prompt + new tokens exceed
``max_len``). Prefill, decode steps and the uncached window all attend through
``kernels.attend`` with ``execution.attention_impl`` (``jaxgpt.config.Execution``), the kernel training uses.
"""
from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.core import validate
from jaxgpt.config import Execution, ModelConfig, check_sampling
from jaxgpt.inference.sampling import argmax, filter_logits, fresh_seed
from jaxgpt.models import build
from jaxgpt.models.decoder import DecoderLM, init_cache, unstack_layers
from jaxgpt.models.stack import check_tokens


def sample_logits(logits, rng, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Next tokens (B,) from logits (B, V). temperature 0 is greedy (argmax, rng unused).

    top_k keeps the k largest logits; top_p keeps the smallest set of tokens whose probability
    reaches p (the first token crossing p is kept, so at least one token always survives): the
    engine's per-row rule (``sampling.filter_logits``) with one setting for every row.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return argmax(logits)
    logits = logits.astype(jnp.float32)
    if top_k is None and top_p is None:  # nothing to filter: no sort of the vocabulary each token
        return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)
    rows = lambda v, dtype: jnp.full(logits.shape[:1], v, dtype)  # one setting, every row
    logits = filter_logits(logits, rows(temperature, jnp.float32), rows(top_k or 0, jnp.int32),
                           rows(1.0 if top_p is None else top_p, jnp.float32))
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _finish(tok, done, eos_id):
    """After EOS a row keeps emitting EOS; returns (token, done)."""
    if eos_id is None:
        return tok, done
    tok = jnp.where(done, eos_id, tok)
    return tok, done | (tok == eos_id)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_k", "top_p", "eos_id", "execution"))
def _generate_cached(params, prompt, rng, *, config, max_new_tokens, temperature, top_k, top_p, eos_id, execution=None):
    # Separate layers and one cache buffer per layer (K/V in the compute dtype): each step then
    # updates the cache in place and reads weights and cache where they lie; no copies per token.
    separate, params = unstack_layers(config, params, execution)
    model = DecoderLM(config, separate)
    b, t0 = prompt.shape
    sample = partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    cache = init_cache(config, b, t0 + max_new_tokens, per_layer=True)
    out = model.apply({"params": params}, prompt, cache=cache)
    tok, done = _finish(sample(out.logits[:, -1], jax.random.fold_in(rng, 0)), jnp.zeros(b, bool), eos_id)
    tokens = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok)

    def cond(state):
        i, _, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(state):
        i, tokens, cache, tok, done = state
        out = model.apply({"params": params}, tok[:, None], cache=cache)
        nxt, done = _finish(sample(out.logits[:, -1], jax.random.fold_in(rng, i)), done, eos_id)
        return i + 1, tokens.at[:, i].set(nxt), out.cache, nxt, done

    i, tokens, *_ , done = jax.lax.while_loop(cond, step, (jnp.int32(1), tokens, out.cache, tok, done))
    if eos_id is not None:  # rows stopped early: fill the untouched tail with EOS
        tokens = jnp.where(jnp.arange(max_new_tokens) >= i, eos_id, tokens)
    return jnp.concatenate([prompt, tokens], axis=1)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_k", "top_p", "eos_id", "execution"))
def _generate_uncached(params, prompt, rng, *, config, max_new_tokens, temperature, top_k, top_p, eos_id,
                       execution=None):
    model = build(config, execution)
    b, t0 = prompt.shape
    w = config.max_len
    sample = partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    window = jnp.zeros((b, w), jnp.int32).at[:, :t0].set(prompt)  # causal: slots past `n` never leak back

    def step(i, state):
        window, n, tokens, done = state
        logits = model.apply({"params": params}, window)  # (B, W, V)
        last = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False)
        tok, done = _finish(sample(last, jax.random.fold_in(rng, i)), done, eos_id)
        full = n == w  # no room left: drop the oldest token (crop to the context window)
        window = jnp.where(full, jnp.roll(window, -1, axis=1), window)
        n = jnp.where(full, n - 1, n)
        window = jax.lax.dynamic_update_slice(window, tok[:, None], (0, n))
        return window, n + 1, tokens.at[:, i].set(tok), done

    init = (window, jnp.int32(t0), jnp.zeros((b, max_new_tokens), jnp.int32), jnp.zeros(b, bool))
    _, _, tokens, _ = jax.lax.fori_loop(0, max_new_tokens, step, init)
    return jnp.concatenate([prompt, tokens], axis=1)


def _default_rng(rng, temperature: float):
    """``rng``, or for sampling without one a key from fresh entropy (greedy decoding draws nothing)."""
    if rng is not None:
        return rng
    return jax.random.PRNGKey(fresh_seed() if temperature > 0 else 0)


def generate(config: ModelConfig, params, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, rng=None, eos_id: int | None = None,
             use_cache: bool = True, execution: Execution | None = None):
    """Continue ``prompt`` (B, T0) int ids by ``max_new_tokens`` tokens -> (B, T0 + max_new_tokens).
    ``execution``: the kernels, and the params' layout (None: ``Execution.for_model(config)``).

    temperature 0 is greedy. With ``eos_id``, a row that emits it is filled with it afterwards.
    ``prompt``: a JAX or NumPy array, or nested lists of ints.

    ``rng``: a PRNG key. Without one, sampling (temperature > 0) draws a fresh seed from the OS, as
    the engine and ``jaxgpt serve`` do for an unseeded request, so two unseeded calls differ; pass
    a key to repeat a sample. The same ``rng`` gives the same tokens with and without the cache.

    The KV cache is used when the whole sequence fits in ``config.max_len``. Past it, decoding
    falls back to the uncached path, which crops the context to the last ``max_len`` tokens, and
    says so in a warning naming the lengths.
    """
    prompt = jnp.asarray(np.asarray(prompt), jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (batch, length>=1) token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if config.residual != "standard":
        use_cache = False
    check_tokens(prompt, config.token_vocab, config.max_len)  # a padded table's extra rows are no tokens
    if eos_id is not None and not 0 <= eos_id < config.token_vocab:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {config.token_vocab})")
    rng = _default_rng(rng, temperature)
    fits = prompt.shape[1] + max_new_tokens <= config.max_len
    if not fits:
        warnings.warn(f"prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} exceeds max_len="
                      f"{config.max_len}: decoding without the KV cache, each token seeing only the last "
                      f"{config.max_len} tokens", stacklevel=2)
    fn = _generate_cached if use_cache and fits else _generate_uncached
    return fn(params, prompt, rng, config=config, max_new_tokens=max_new_tokens, temperature=float(temperature),
              top_k=top_k, top_p=top_p, eos_id=eos_id, execution=execution)


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_k", "top_p", "bos_id", "eos_id",
                                   "execution"))
def _generate_seq2seq(params, src, src_mask, rng, *, config, max_new_tokens, temperature, top_k, top_p, bos_id,
                      eos_id, execution=None):
    from jaxgpt.models.encdec import EncoderDecoder

    model = build(config, execution)
    sample = partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    memory = model.apply({"params": params}, src, src_mask, method=EncoderDecoder.encode)  # (B, S, d)
    b = src.shape[0]
    tgt = jnp.zeros((b, max_new_tokens + 1), jnp.int32).at[:, 0].set(bos_id)  # causal: later slots unseen

    def step(i, state):
        tgt, done = state
        logits = model.apply({"params": params}, tgt, memory, src_mask, method=EncoderDecoder.decode)
        last = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)  # (B, V)
        tok, done = _finish(sample(last, jax.random.fold_in(rng, i)), done, eos_id)
        return jax.lax.dynamic_update_slice(tgt, tok[:, None], (0, i + 1)), done

    tgt, _ = jax.lax.fori_loop(0, max_new_tokens, step, (tgt, jnp.zeros(b, bool)))
    return tgt[:, 1:]


def generate_seq2seq(config, params, src, src_mask, max_new_tokens: int, *, bos_id: int, eos_id: int | None = None,
                     temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, rng=None,
                     execution: Execution | None = None):
    """Encoder-decoder decoding: encode ``src`` (B, S) once, then feed ``<bos>`` + the tokens so
    far to the decoder (one fixed (B, max_new_tokens + 1) window, no recompilation per token).
    Returns the new tokens (B, max_new_tokens); rows that emit ``eos_id`` are filled with it.
    Without ``rng``, sampling draws a fresh seed, as ``generate`` does."""
    src = jnp.asarray(np.asarray(src), jnp.int32)
    validate.check_padding_mask(np.asarray(src_mask), src.shape, where="src_mask")  # no float masks cast to bool
    src_mask = jnp.asarray(np.asarray(src_mask), bool)
    if max_new_tokens < 1 or max_new_tokens + 1 > config.decoder.max_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be in [1, decoder.max_len - 1 = "
                         f"{config.decoder.max_len - 1}]")
    check_tokens(src, config.encoder.vocab_size, config.encoder.max_len)
    for name, i in (("bos_id", bos_id), ("eos_id", eos_id)):  # fed to the jitted decoder, which would clamp
        if i is not None and not 0 <= i < config.decoder.vocab_size:
            raise ValueError(f"{name} {i} is outside the decoder vocabulary [0, {config.decoder.vocab_size})")
    rng = _default_rng(rng, temperature)
    return _generate_seq2seq(params, src, src_mask, rng, config=config, max_new_tokens=max_new_tokens,
                             temperature=float(temperature), top_k=top_k, top_p=top_p, bos_id=bos_id, eos_id=eos_id,
                             execution=execution)
