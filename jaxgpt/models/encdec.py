"""Encoder-decoder Transformer (seed 004): a bidirectional encoder stack, a causal decoder stack whose
Blocks add cross-attention over the encoder output, and an output projection.

Parameters: encoder/{tok_embed, pos_embed?, layers, norm?}, decoder/{tok_embed, pos_embed?, layers,
norm?}, out_proj. ``layers`` are scanned (leading layer axis; ``layers_0, layers_1, ...`` when that
Execution's ``scan_layers`` is False); the converter maps them to torch_ref's ``encoder.layers.{i}.…``
keys with ``stacked=stacked_paths(config)`` (``STACKED`` for the default layout).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config import EncDecConfig, Execution, ModelConfig
from jaxgpt.core.layout import ENCDEC_STACKED as STACKED  # noqa: F401  (re-exported: the scanned stacks)
from jaxgpt.models.bert import key_mask
from jaxgpt.models.stack import check_tokens, embed_tokens, run_blocks
from jaxgpt.nn.mlp import dense
from jaxgpt.nn.norms import norm_from_config
from jaxgpt.nn.kernels.precision import module_scope


class Stack(nn.Module):
    """Embeddings -> n_layer Blocks -> optional final norm. ``cross``: a decoder stack (causal
    self-attention + cross-attention over ``memory``)."""

    config: ModelConfig
    execution: Execution = Execution()  # the kernels, layer scan and precision (jaxgpt.config.execution)
    cross: bool = False

    @nn.compact
    @module_scope
    def __call__(self, ids, memory=None, memory_mask=None, self_mask=None, *, deterministic=True):
        """ids: (B, T) int; memory: (B, S, d); masks: (B, 1, 1, S|T) bool. Returns (B, T, d)."""
        cfg = self.config
        ids = jnp.asarray(ids)  # NumPy arrays and nested lists too
        check_tokens(ids, cfg.vocab_size, cfg.max_len)
        positions = jnp.arange(ids.shape[-1])  # (T,)
        tok_embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std),
                             dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="tok_embed")
        x = embed_tokens(cfg, tok_embed, ids, positions, deterministic)  # (B, T, d)
        x, _, _ = run_blocks(cfg, x, causal=self.cross, cross=self.cross, context=memory, mask=self_mask,
                             context_mask=memory_mask, positions=positions, deterministic=deterministic,
                             execution=self.execution)
        if cfg.final_norm:
            x = norm_from_config(cfg, "norm", self.execution)(x)
        return x


class EncoderDecoder(nn.Module):
    """``apply({'params': p}, src_ids, tgt_ids, src_mask)`` -> logits (B, T_tgt, decoder.vocab_size)."""

    config: EncDecConfig
    execution: Execution = Execution()  # the kernels, layer scan and precision (jaxgpt.config.execution)

    def setup(self):
        cfg = self.config
        self.encoder = Stack(cfg.encoder, self.execution)
        self.decoder = Stack(cfg.decoder, self.execution, cross=True)
        dec = cfg.decoder  # logits: float32 out whatever the decoder's compute dtype
        self.out_proj = dense(dec.vocab_size, cfg.out_bias, dec.init_std, "out_proj", dtype=dec.dtype,
                              param_dtype=dec.param_dtype, f32_out=True)

    def encode(self, src_ids, src_mask=None, *, deterministic=True):
        """src_ids: (B, S) int; src_mask: (B, S), True = real token. Returns memory (B, S, d)."""
        return self.encoder(src_ids, self_mask=key_mask(src_mask, src_ids.shape), deterministic=deterministic)

    @module_scope
    def decode(self, tgt_ids, memory, src_mask=None, *, deterministic=True):
        """tgt_ids: (B, T) int; memory: (B, S, d) from ``encode``. Returns logits (B, T, vocab)."""
        mask = key_mask(src_mask, memory.shape[:2])  # (B, 1, 1, S)
        h = self.decoder(tgt_ids, memory, mask, deterministic=deterministic)  # (B, T, d)
        return self.out_proj(h)

    @module_scope
    def __call__(self, src_ids, tgt_ids, src_mask=None, *, deterministic=True):
        """Teacher-forced logits (B, T_tgt, decoder.vocab_size); src_mask (B, S), True = real token."""
        memory = self.encode(src_ids, src_mask, deterministic=deterministic)
        return self.decode(tgt_ids, memory, src_mask, deterministic=deterministic)
