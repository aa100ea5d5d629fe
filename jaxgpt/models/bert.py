"""BERT-style sequence classifier: seed 004's MiniBERT and the standard BERT layout are presets.

tok_embed + pos_embed (+ type_embed) -> [embed_norm] -> dropout -> n_layer bidirectional Blocks
(nn.scan, params stacked under ``layers``) -> [norm] -> h[:, 0] ([CLS]) -> [pooler: tanh(dense)]
-> dropout -> classifier.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.nn import checks
from jaxgpt.core import validate
from jaxgpt.config import BertConfig, Execution
from jaxgpt.models.stack import check_tokens, embed_tokens, run_blocks
from jaxgpt.nn.norms import norm_from_config
from jaxgpt.nn.kernels.precision import module_scope


class BertOutput(NamedTuple):
    logits: jax.Array  # (B, n_classes)
    attn_weights: jax.Array | None  # (L, B, H, T, T)


def key_mask(attention_mask, shape):
    """(B, T) padding mask, 1/True = real token -> (B, 1, 1, T) bool key mask (None stays None).
    Bool or 0/1 integers of the ids' shape; a float mask (maybe additive 0/-inf) is an error."""
    if attention_mask is None:
        return None
    traced = checks.is_traced(attention_mask)
    validate.check_padding_mask(attention_mask, shape, values=not traced)
    if traced and attention_mask.dtype != jnp.bool_:
        checks.check_in_range(attention_mask, 2, "attention_mask value", space="the 0/1 values")
    return jnp.asarray(attention_mask).astype(bool)[:, None, None, :]


class BertClassifier(nn.Module):
    """``apply({'params': p}, input_ids, attention_mask, token_type_ids)`` -> logits (B, n_classes)."""

    config: BertConfig
    execution: Execution = Execution()  # the kernels, layer scan and precision (jaxgpt.config.execution)

    @nn.compact
    @module_scope
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=True,
                 return_weights=False, return_hidden=False):
        """input_ids: (B, T) int. attention_mask: (B, T), 1/True = real token (keys at 0 are masked).
        token_type_ids: (B, T) int in [0, type_vocab_size) (default zeros).

        Returns logits (B, n_classes); a BertOutput (logits, per-layer weights (L, B, H, T, T)) when
        ``return_weights``; the final hidden states (B, T, d) when ``return_hidden`` (see ``encode``).
        """
        cfg, enc = self.config, self.config.encoder
        input_ids = jnp.asarray(input_ids)  # NumPy arrays and nested lists too
        check_tokens(input_ids, enc.vocab_size, enc.max_len)
        positions = jnp.arange(input_ids.shape[-1])  # (T,)
        dt = dict(dtype=enc.dtype, param_dtype=enc.param_dtype)  # precision policy: the encoder config's
        tok_embed = nn.Embed(enc.vocab_size, enc.d_model, embedding_init=nn.initializers.normal(enc.init_std),
                             name="tok_embed", **dt)
        x = embed_tokens(enc, tok_embed, input_ids, positions, deterministic=True)  # (B, T, d), dropout below
        if cfg.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = jnp.zeros_like(input_ids)
            else:
                token_type_ids = jnp.asarray(token_type_ids)
                check_tokens(token_type_ids, cfg.type_vocab_size, enc.max_len)
            x = x + nn.Embed(cfg.type_vocab_size, enc.d_model, embedding_init=nn.initializers.normal(enc.init_std),
                             name="type_embed", **dt)(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but config.type_vocab_size=0 (no token-type embeddings)")
        if cfg.embed_norm:
            x = norm_from_config(enc, "embed_norm", self.execution)(x)
        x = nn.Dropout(enc.dropout)(x, deterministic=deterministic)

        mask = key_mask(attention_mask, input_ids.shape)  # (B, 1, 1, T)
        x, _, weights = run_blocks(enc, x, causal=False, mask=mask, positions=positions,
                                   return_weights=return_weights, deterministic=deterministic,
                                   execution=self.execution)
        if enc.final_norm:
            x = norm_from_config(enc, "norm", self.execution)(x)
        if return_hidden:
            return x  # (B, T, d)

        init = nn.initializers.normal(enc.init_std)
        pooled = x[:, 0]  # (B, d): the [CLS] position
        if cfg.pooler == "tanh":
            pooled = jnp.tanh(nn.Dense(enc.d_model, kernel_init=init, name="pooler", **dt)(pooled))
        pooled = nn.Dropout(enc.dropout)(pooled, deterministic=deterministic)
        f32_out = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)  # logits stay float32
        logits = nn.Dense(cfg.n_classes, kernel_init=init, dot_general=f32_out, name="classifier", **dt)(pooled)
        return BertOutput(logits, weights) if return_weights else logits

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=True):
        """Final hidden states (B, T, d) (after the final norm, before pooling).
        ``model.apply({'params': p}, ids, mask, method=BertClassifier.encode)``."""
        return self(input_ids, attention_mask, token_type_ids, deterministic=deterministic, return_hidden=True)

