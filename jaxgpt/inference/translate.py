"""Greedy translation of every pair, with exact-match accuracy (seed 002's and seed 004's test).

A decoder (ModelConfig) reads ``<bos> src <sep>`` and continues it; an encoder-decoder
(EncDecConfig) encodes ``src`` and decodes from ``<bos>``. Both stop at ``<eos>``, and outputs
are read as seed 002's ``decode_en`` reads them (``PairTokenizer.decode_en``).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import EncDecConfig, ModelConfig
from jaxgpt.data import PairTokenizer, pad_batch


@partial(jax.jit, static_argnames=("config", "steps"))
def _greedy_rows(params, tokens, lengths, *, config: ModelConfig, steps: int):
    """Greedy continuation of prompts of different lengths in one fixed (N, W) window.

    Row r's prompt fills tokens[r, :lengths[r]]; each iteration runs the whole window once
    (causal attention: slots past a row's cursor are invisible to it) and writes every row's
    next token at its own cursor. One compile for any mix of prompt lengths; AttnRes models,
    which have no KV cache, decode the same way."""
    from jaxgpt.models.decoder import DecoderLM

    model = DecoderLM(config)
    rows = jnp.arange(tokens.shape[0])

    def step(_, state):
        tokens, cur, done = state
        logits = model.apply({"params": params}, tokens)  # (N, W, V)
        nxt = jnp.argmax(logits[rows, cur - 1], axis=-1).astype(jnp.int32)  # (N,)
        write = ~done & (cur < tokens.shape[1])
        at = jnp.minimum(cur, tokens.shape[1] - 1)  # a finished row rewrites its last slot unchanged
        tokens = tokens.at[rows, at].set(jnp.where(write, nxt, tokens[rows, at]))
        done = done | (write & (nxt == PairTokenizer.eos_id))
        return tokens, cur + write.astype(jnp.int32), done

    tokens, _, _ = jax.lax.fori_loop(0, steps, step, (tokens, lengths, jnp.zeros(tokens.shape[0], bool)))
    return tokens


def translate_all(config, params, tokenizer: PairTokenizer, pairs: Sequence[tuple[str, str]], *,
                  max_new_tokens: int | None = None) -> dict:
    """Greedy-decode every pair's source and compare with its target.

    max_new_tokens: tokens generated per source (default: the longest target + 2, room for
    ``<eos>`` and one token more, so an output that runs past its target never matches).
    Returns {outputs: [str], exact: matches, n: len(pairs), accuracy: exact / n}.
    """
    if not pairs:
        raise ValueError("translate_all needs at least one (src, tgt) pair")
    tgt_lens = [len(tokenizer.encode(t)) for _, t in pairs]
    budget = max(tgt_lens) + 2 if max_new_tokens is None else max_new_tokens
    if budget < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {budget}")
    if isinstance(config, EncDecConfig):
        from jaxgpt.inference.generate import generate_seq2seq

        src, mask = pad_batch([tokenizer.encode(s) for s, _ in pairs], config.encoder.max_len, tokenizer.pad_id)
        width = int(mask.sum(1).max())
        out = generate_seq2seq(config, params, src[:, :width], mask[:, :width], budget,
                               bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        # decoded as seed 002 decodes: from after a <sep> to the first <eos>/<pad>, later <sep>s skipped
        outputs = [tokenizer.decode_en([tokenizer.sep_id, *row]) for row in np.asarray(out).tolist()]
    elif isinstance(config, ModelConfig):
        prompts = [tokenizer.prompt(s) for s, _ in pairs]
        width = max(len(p) for p in prompts) + budget
        if width > config.max_len:
            raise ValueError(f"the longest prompt ({max(len(p) for p in prompts)} tokens) plus max_new_tokens="
                             f"{budget} needs a context of {width}, but max_len={config.max_len}")
        tokens, _ = pad_batch(prompts, width, tokenizer.pad_id)
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        out = np.asarray(_greedy_rows(params, jnp.asarray(tokens), jnp.asarray(lengths), config=config, steps=budget))
        outputs = [tokenizer.decode_en(row) for row in out]  # the English after the prompt's <sep>
    else:
        raise TypeError(f"translate_all takes a ModelConfig or EncDecConfig, got {type(config).__name__}")
    exact = sum(o == t.strip() for o, (_, t) in zip(outputs, pairs))
    return {"outputs": outputs, "exact": exact, "n": len(pairs), "accuracy": exact / len(pairs)}


__all__ = ["translate_all"]
