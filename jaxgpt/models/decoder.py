"""Decoder-only language model: GPT-2, LLaMA and seed MiniGPT are presets of this one class.

tok_embed (+ pos_embed | sinusoidal | RoPE inside attention) -> dropout -> n_layer Blocks stacked
with ``nn.scan`` (one compiled layer body; params carry a leading layer axis), or separate
``layers_{i}`` when ``config.scan_layers`` is False -> norm -> lm_head (or the transposed token
embedding when tied).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxgpt import checks, validate
from jaxgpt.attention import KVCache
from jaxgpt.block import Block
from jaxgpt.config import ModelConfig
from jaxgpt.mlp import dense
from jaxgpt.norms import make_norm
from jaxgpt.positions import sinusoidal_table


class DecoderOutput(NamedTuple):
    logits: jax.Array  # (B, T, vocab)
    cache: KVCache | None  # leaves stacked over layers: k, v (L, B, H_kv, S, D), index (L,)
    attn_weights: jax.Array | None  # (L, B, H, T, S)


def init_cache(config: ModelConfig, batch: int, max_len: int | None = None, dtype=jnp.float32) -> KVCache:
    """An empty KV cache for every layer: k, v (L, B, H_kv, max_len, D), index (L,)."""
    s = config.max_len if max_len is None else max_len
    c = KVCache.init(batch, config.kv_heads, s, config.head_dim, dtype)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layer,) + a.shape), c)


def check_tokens(tokens, vocab_size: int, max_len: int, offset: int = 0) -> None:
    """Raise ValueError for ids outside [0, vocab_size) or sequences past the context window.

    JAX gathers clamp bad indices silently, so concrete (eager) inputs are checked here on the
    host; traced inputs (under jit) get the same checks as checkify debug checks, reported in
    checked mode (``jaxgpt.checks.checked``) and compiled away otherwise.
    """
    t = tokens.shape[-1]
    if not checks.is_traced(offset):
        offset = int(offset)
        if offset + t > max_len:
            raise ValueError(f"{t} tokens after {offset} cached positions exceed max_len={max_len}")
    elif t > max_len:
        raise ValueError(f"{t} tokens exceed max_len={max_len}")
    else:
        checkify.debug_check(offset + t <= max_len, f"{t} tokens after {{offset}} cached positions exceed "
                             f"max_len={max_len}", offset=offset)
    if checks.is_traced(tokens):
        checks.check_in_range(tokens, vocab_size, "token id")
    else:
        validate.check_ids(tokens, vocab_size)


def embed_tokens(config: ModelConfig, tok_embed: nn.Embed, tokens, positions, deterministic: bool):
    """Token (+ absolute position) embeddings with dropout. Call inside a compact module."""
    cfg = config
    init = nn.initializers.normal(cfg.init_std)
    x = tok_embed(tokens)  # (B, T, d)
    if cfg.embed_scale:
        x = x * np.float32(np.sqrt(cfg.d_model))
    if cfg.pos == "learned":
        x = x + nn.Embed(cfg.max_len, cfg.d_model, embedding_init=init, name="pos_embed")(positions)
    elif cfg.pos == "sinusoidal":
        x = x + jnp.asarray(sinusoidal_table(cfg.max_len, cfg.d_model))[positions]
    return nn.Dropout(cfg.dropout)(x, deterministic=deterministic)


def remat_policy(name: str):
    """``config.remat`` -> the jax.checkpoint policy passed to nn.remat ('full': save nothing)."""
    return None if name == "full" else getattr(jax.checkpoint_policies, name)


def run_blocks(config: ModelConfig, x, *, causal=True, cross=False, context=None, mask=None,
               context_mask=None, positions=None, cache=None, return_weights=False, deterministic=True,
               name="layers"):
    """n_layer Blocks. Call inside a compact module. Returns (x, cache, weights).

    ``config.scan_layers``: one Block under nn.scan (params (L, ...) under ``name``, unrolled
    ``config.scan_unroll`` layers per loop iteration), or a Python loop over Blocks named
    ``{name}_0, {name}_1, ...`` (one compiled body per layer). Either way the cache and the
    weights are stacked (L, ...). ``config.remat`` wraps each layer in nn.remat.
    """

    def body(block, h, layer_cache):
        h, new_cache, w = block(h, context, mask=mask, context_mask=context_mask, positions=positions,
                                cache=layer_cache, return_weights=return_weights, deterministic=deterministic)
        return h, (new_cache, w)

    if config.remat != "none":
        # Inside a scan the loop already keeps XLA from merging the recomputation back into the forward
        # pass, so the optimisation barriers of prevent_cse are only needed for separate layers (JAX docs).
        body = nn.remat(body, policy=remat_policy(config.remat), prevent_cse=not config.scan_layers)
    if not config.scan_layers:
        outs = []
        for i in range(config.n_layer):
            layer_cache = None if cache is None else jax.tree.map(lambda a: a[i], cache)  # noqa: B023
            x, out = body(Block(config, causal=causal, cross=cross, name=f"{name}_{i}"), x, layer_cache)
            outs.append(out)
        cache, weights = jax.tree.map(lambda *a: jnp.stack(a), *outs)  # (L, ...) as the scan stacks them
        return x, cache, weights

    # "intermediates": 0 stacks what capture_intermediates / sow record per layer (jaxgpt.parity reads
    # each Block's output from it); without that collection mutable, nothing changes.
    scan = nn.scan(body, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True, "dropout": True},
                   in_axes=0, length=config.n_layer, unroll=config.scan_unroll)
    x, (cache, weights) = scan(Block(config, causal=causal, cross=cross, name=name), x, cache)
    return x, cache, weights


class DecoderLM(nn.Module):
    """Causal language model. ``apply({'params': p}, tokens)`` -> logits (B, T, vocab)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, *, positions=None, cache: KVCache | None = None, mask=None,
                 return_weights: bool = False, deterministic: bool = True):
        """tokens: (B, T) int ids. positions: (T,) or (B, T) (default: cache index + arange(T)).
        cache: from ``init_cache``; the call writes this chunk's keys/values and returns it.
        mask: optional (B, 1, 1, S) key mask (True = attend), e.g. left padding of prompts.

        Returns logits (B, T, vocab), or a DecoderOutput when a cache is passed or
        ``return_weights`` (per-layer attention weights) is set.
        """
        cfg = self.config
        offset = 0 if cache is None else cache.index[0]
        check_tokens(tokens, cfg.vocab_size, cfg.max_len, 0 if cache is None else offset)
        if cache is not None:  # here, outside nn.scan, so the check also holds for traced indices
            capacity, t = cache.k.shape[-2], tokens.shape[-1]
            if checks.is_traced(offset):
                checks.check_cache_room(offset, t, capacity)
            else:
                validate.check_cache_room(int(offset), t, capacity)
        if positions is None:
            positions = offset + jnp.arange(tokens.shape[-1])
        tok_embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std),
                             name="tok_embed")
        x = embed_tokens(cfg, tok_embed, tokens, positions, deterministic)
        weights = None
        if cfg.residual == "standard":
            x, cache, weights = run_blocks(cfg, x, mask=mask, positions=positions, cache=cache,
                                           return_weights=return_weights, deterministic=deterministic)
        else:
            from jaxgpt.attnres import AttnResLayers

            if cache is not None:
                raise ValueError(f"residual={cfg.residual!r} does not support a KV cache; decode without one")
            x, weights = AttnResLayers(cfg, name="layers")(x, mask=mask, positions=positions,
                                                          return_weights=return_weights,
                                                          deterministic=deterministic)
        if cfg.final_norm:
            x = make_norm(cfg.norm, cfg.norm_eps, cfg.norm_bias, name="norm")(x)
        if cfg.tie_embeddings:
            logits = tok_embed.attend(x)  # x @ embedding.T
        else:
            logits = dense(cfg.vocab_size, False, cfg.init_std, "lm_head")(x)
        if cache is None and not return_weights:
            return logits
        return DecoderOutput(logits, cache, weights)
