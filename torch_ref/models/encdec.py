"""Encoder-decoder Transformer mirroring jaxgpt/models/encdec.py (encoder.{tok_embed, layers.{i}, norm},
decoder.{tok_embed, layers.{i}, norm}, out_proj)."""
from __future__ import annotations

import torch
from torch import nn

from jaxgpt.config import EncDecConfig, ModelConfig
from torch_ref.nn.block import Block
from torch_ref.models.bert import key_mask
from torch_ref.models.stack import add_embeddings, check_tokens, embed_tokens
from torch_ref.nn.norms import norm_from_config


class Stack(nn.Module):
    """Embeddings -> n_layer Blocks -> optional final norm; ``cross``: a decoder stack."""

    def __init__(self, config: ModelConfig, cross: bool = False):
        super().__init__()
        cfg = self.config = config
        self.cross = cross
        add_embeddings(self, cfg)
        self.layers = nn.ModuleList(Block(cfg, causal=cross, cross=cross) for _ in range(cfg.n_layer))
        self.norm = norm_from_config(cfg) if cfg.final_norm else None

    def forward(self, ids, memory=None, memory_mask=None, self_mask=None):
        """ids: (B, T) int; memory: (B, S, d); masks: (B, 1, 1, S|T) bool. Returns (B, T, d)."""
        check_tokens(ids, self.config.vocab_size, self.config.max_len)
        positions = torch.arange(ids.shape[-1], device=ids.device)
        x = embed_tokens(self, self.config, ids, positions)  # (B, T, d)
        for layer in self.layers:
            x, _, _ = layer(x, memory, mask=self_mask, context_mask=memory_mask, positions=positions)
        return x if self.norm is None else self.norm(x)


class EncoderDecoder(nn.Module):
    """``model(src_ids, tgt_ids, src_mask)`` -> logits (B, T_tgt, decoder.vocab_size)."""

    def __init__(self, config: EncDecConfig):
        super().__init__()
        self.config = config
        self.encoder = Stack(config.encoder)
        self.decoder = Stack(config.decoder, cross=True)
        self.out_proj = nn.Linear(config.decoder.d_model, config.decoder.vocab_size, bias=config.out_bias)
        nn.init.normal_(self.out_proj.weight, std=config.decoder.init_std)
        if config.out_bias:
            nn.init.zeros_(self.out_proj.bias)

    def encode(self, src_ids, src_mask=None):
        """Memory (B, S, d); src_mask (B, S), True = real token."""
        return self.encoder(src_ids, self_mask=key_mask(src_mask, src_ids.shape))

    def decode(self, tgt_ids, memory, src_mask=None):
        """Logits (B, T, vocab) for tgt_ids (B, T) over memory (B, S, d)."""
        return self.out_proj(self.decoder(tgt_ids, memory, key_mask(src_mask, memory.shape[:2])))

    def forward(self, src_ids, tgt_ids, src_mask=None):
        return self.decode(tgt_ids, self.encode(src_ids, src_mask), src_mask)
