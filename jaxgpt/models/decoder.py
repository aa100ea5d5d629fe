"""Decoder-only language model: GPT-2, LLaMA and seed MiniGPT are presets of this one class.

tok_embed (+ pos_embed | sinusoidal | RoPE inside attention) -> dropout -> n_layer Blocks stacked
with ``nn.scan`` (one compiled layer body; params carry a leading layer axis), or separate
``layers_{i}`` when ``execution.scan_layers`` is False -> norm -> lm_head (or the transposed token
embedding when tied).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.nn.kv_cache import KVCache, KVCacheLike
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.nn.kernels.linear import logits as logits_matmul
from jaxgpt.nn.mlp import dense
from jaxgpt.nn.norms import norm_from_config
from jaxgpt.nn.kernels.precision import module_scope
from jaxgpt.nn.kernels.softcap import softcap
from jaxgpt.models.stack import check_tokens, embed_tokens, run_blocks


class DecoderOutput(NamedTuple):
    logits: jax.Array | None  # (B, T, vocab); None with hidden=True
    # the cache form the call was given, written: one 'stacked' KVCache (k, v (L, B, H_kv, S, D), index (L,)),
    # or a tuple of L one-layer caches (KVCache 'rows' from init_cache(..., per_layer=True) or 'heads', or
    # the engine's PagedKVCaches: nn/kv_cache.py's contract)
    cache: KVCache | tuple[KVCacheLike, ...] | None
    attn_weights: jax.Array | None  # (L, B, H, T, S)
    # AttnRes models with return_depth_weights: (Q, B, T, N_max), Q pseudo-queries (2 per layer, then
    # the output aggregation in 'paper'), softmax over the sources in order, zero past each query's sources
    depth_weights: jax.Array | None = None
    hidden: jax.Array | None = None  # with hidden=True: the hidden states after the final norm (B, T, d_model)


def init_cache(config: ModelConfig, batch: int, max_len: int | None = None, dtype=None, *,
               per_layer: bool = False) -> KVCache | tuple[KVCache, ...]:
    """An empty KV cache for every layer: one KVCache of layout 'stacked', k, v (L, B, H_kv, max_len, D),
    index (L,), in ``dtype`` (default: the compute dtype ``config.dtype``, the dtype the keys and
    values are computed in).

    per_layer: a tuple of L separate KVCaches of layout 'rows', k, v (B * H_kv, max_len, D) (row
    b * H_kv + h) instead, what generate() decodes with. With unstacked layers (``unstack_layers``)
    every attention gets its own cache buffer in the layout XLA's dots read in place, so a decode
    step writes only the new slots and copies nothing cache-sized; a slice k[l] of a stacked cache
    is copied out per layer and step (docs/decoding.md).
    """
    s = config.max_len if max_len is None else max_len
    dtype = config.dtype if dtype is None else dtype
    if per_layer:
        return tuple(KVCache.init(batch, config.kv_heads, s, config.head_dim, dtype, layout="rows")
                     for _ in range(config.n_layer))
    shape = (config.n_layer, batch, config.kv_heads, s, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((config.n_layer,), jnp.int32),
                   "stacked")


def unstack_layers(config: ModelConfig, params, execution: Execution | None = None, name: str = "layers"):
    """(execution, params) in the separate-layers layout (``scan_layers=False``): the scanned ``name``
    params (L, ...) become ``{name}_0`` ... ``{name}_{L-1}``. Unchanged when already unscanned.

    Decoding uses it: a scanned layer loop slices (copies) every layer's weights out of the
    stacked arrays on every step; separate arrays are read in place.
    """
    execution = Execution.for_model(config, execution).replace(scan_layers=False)
    if name not in params:
        return execution, params
    out = {k: v for k, v in params.items() if k != name}
    out.update({f"{name}_{i}": jax.tree.map(lambda a: a[i], params[name]) for i in range(config.n_layer)})  # noqa: B023 - called in this iteration
    return execution, out


def mask_padded_vocab(config: ModelConfig, logits):
    """logits (..., vocab_size) float32 with the padded ids (>= config.valid_vocab) at the float32 minimum:
    softmax gives them exactly 0 (so the loss, samplers and the engine never pick them) and the where
    passes them no gradient. The minimum, not -inf: no inf - inf = NaN in a softmax or a KL term."""
    if config.valid_vocab is None:
        return logits
    padded = jnp.arange(logits.shape[-1]) >= config.valid_vocab  # (vocab,)
    return jnp.where(padded, jnp.finfo(logits.dtype).min, logits)


def final_logits(config: ModelConfig, logits):
    """The head's float32 logits (..., V) as the model gives them: soft-capped to ``config.logit_softcap``
    (Gemma 2: cap * tanh(logits / cap)), then the padded ids masked (``mask_padded_vocab``). Every logits
    path runs it: DecoderLM's head and the engine's packed panel head (inference/packed_head.py)."""
    if config.logit_softcap is not None:
        logits = softcap(logits, config.logit_softcap)
    return mask_padded_vocab(config, logits)


class DecoderLM(nn.Module):
    """Causal language model. ``apply({'params': p}, tokens)`` -> logits (B, T, vocab)."""

    config: ModelConfig
    execution: Execution = Execution()  # the kernels, layer scan and precision (jaxgpt.config.execution)

    @nn.compact
    @module_scope
    def __call__(self, tokens, *, positions=None, cache: KVCache | None = None, mask=None,
                 return_weights: bool = False, return_depth_weights: bool = False, deterministic: bool = True,
                 logits_at=None, segment_ids=None, hidden: bool = False):
        """tokens: (B, T) int ids. positions: (T,) or (B, T) (default: cache index + arange(T)).
        cache: from ``init_cache``; the call writes this chunk's keys/values and returns it.
        mask: optional (B, 1, 1, S) key mask (True = attend), e.g. left padding of prompts.
        segment_ids: optional (B, T) ids of documents packed into each row (no cache): attention
        stays inside a document (``jaxgpt.data.documents`` makes them, and positions restarting
        per document, from the EOS ids).

        logits_at: optional (B,) positions: logits only there, (B, 1, vocab) (the vocabulary projection
        of the other positions is skipped).
        hidden: the hidden states after the final norm, (B, T, d_model), instead of the logits (a
        DecoderOutput's ``hidden``, logits None): for a caller that projects them itself (the serving
        engine's packed head, inference/packed_head.py).
        Returns logits (B, T, vocab), or a DecoderOutput when a cache is passed or
        ``return_weights`` (per-layer attention weights) or ``return_depth_weights`` (AttnRes
        models: the depth-attention weights, ``DecoderOutput.depth_weights``) is set.
        """
        cfg, ex = self.config, self.execution
        tokens = jnp.asarray(tokens)  # NumPy arrays and nested lists too
        first = cache if cache is None or isinstance(cache, KVCache) else cache[0]  # stacked, or layer 0's
        offset = None if cache is None else first.offset  # None: no cache, or a paged one (positions given)
        check_tokens(tokens, cfg.token_vocab, cfg.max_len, 0 if offset is None else offset)
        if cache is not None:  # here too, outside nn.scan: an eager call's index is still concrete
            first.room(tokens.shape[-1])
        if positions is None:
            if cache is not None and offset is None:
                raise ValueError(f"a {type(first).__name__} starts each row at its own position: pass positions")
            positions = (0 if offset is None else offset) + jnp.arange(tokens.shape[-1])
        tok_embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std),
                             dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="tok_embed")
        x = embed_tokens(cfg, tok_embed, tokens, positions, deterministic)
        weights = depth = None
        if return_depth_weights and cfg.residual == "standard":
            raise ValueError("return_depth_weights: a residual='standard' model has no depth attention "
                             "(residual='full_attnres' or 'block_attnres' have)")
        if cfg.residual == "standard":
            x, cache, weights = run_blocks(cfg, x, mask=mask, positions=positions, cache=cache,
                                           return_weights=return_weights, deterministic=deterministic,
                                           segment_ids=segment_ids, execution=ex)
        else:
            from jaxgpt.nn.attnres import AttnResLayers

            if cache is not None:
                raise ValueError(f"residual={cfg.residual!r} does not support a KV cache; decode without one")
            x, weights, *depth = AttnResLayers(cfg, ex, name="layers")(
                x, mask=mask, positions=positions, return_weights=return_weights,
                return_depth_weights=return_depth_weights, deterministic=deterministic, segment_ids=segment_ids)
            depth = depth[0] if depth else None
        if logits_at is not None:  # (B,) one position per row: the engine's prefill skips the other rows' head
            x = x[jnp.arange(x.shape[0]), logits_at][:, None]  # (B, 1, d)
        if cfg.final_norm:
            x = norm_from_config(cfg, "norm", ex)(x)
        if hidden:
            return x if cache is None and not return_weights and not return_depth_weights else DecoderOutput(
                None, cache, weights, depth, hidden=x)
        # Logits are float32 whatever the compute dtype: the matmul reads compute-dtype inputs but
        # accumulates and returns float32 (bfloat16 logits would carry ~3 significant digits into the loss).
        if cfg.tie_embeddings:
            logits = logits_matmul(x, tok_embed.embedding, w_rows=True)  # x @ embedding.T: (..., vocab)
        else:
            logits = dense(cfg.vocab_size, cfg.lm_head_bias, cfg.init_std, "lm_head", dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                           f32_out=True)(x)
        logits = final_logits(cfg, logits)  # soft-capped (logit_softcap), padded ids masked
        if cache is None and not return_weights and not return_depth_weights:
            return logits
        return DecoderOutput(logits, cache, weights, depth)
