"""BERT-style sequence classifier mirroring jaxgpt/models/bert.py (tok_embed, pos_embed, type_embed,
embed_norm, layers.{i}, norm, pooler, classifier)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from jaxgpt.core import validate
from jaxgpt.config import BertConfig
from torch_ref.nn.block import Block
from torch_ref.models.stack import add_embeddings, check_tokens, embed_tokens
from torch_ref.nn.norms import norm_from_config


class BertOutput(NamedTuple):
    logits: torch.Tensor  # (B, n_classes)
    attn_weights: torch.Tensor | None  # (L, B, H, T, T)


def key_mask(attention_mask, shape):
    """(B, T) padding mask, 1/True = real token -> (B, 1, 1, T) bool key mask (None stays None).
    Bool or 0/1 integers of the ids' shape; a float mask (maybe additive 0/-inf) is an error."""
    if attention_mask is None:
        return None
    m = torch.as_tensor(attention_mask)
    validate.check_padding_mask(m if m.dtype == torch.bool else m.cpu(), shape)  # as jaxgpt: no float masks
    return m.bool()[:, None, None, :]


class BertClassifier(nn.Module):
    """``model(input_ids, attention_mask, token_type_ids)`` -> logits (B, n_classes)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        enc = config.encoder
        add_embeddings(self, enc)
        self.embed_drop = nn.Identity()  # dropout comes after the type embedding and embed_norm
        if config.type_vocab_size > 0:
            self.type_embed = nn.Embedding(config.type_vocab_size, enc.d_model)
            nn.init.normal_(self.type_embed.weight, std=enc.init_std)
        norm = lambda: norm_from_config(enc)
        self.embed_norm = norm() if config.embed_norm else None
        self.drop = nn.Dropout(enc.dropout)
        self.layers = nn.ModuleList(Block(enc, causal=False) for _ in range(enc.n_layer))
        self.norm = norm() if enc.final_norm else None
        self.pooler = nn.Linear(enc.d_model, enc.d_model) if config.pooler == "tanh" else None
        self.classifier = nn.Linear(enc.d_model, config.n_classes)
        for lin in (self.pooler, self.classifier):
            if lin is not None:
                nn.init.normal_(lin.weight, std=enc.init_std)
                nn.init.zeros_(lin.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, *, return_weights=False,
                return_hidden=False):
        """Same contract as jaxgpt's BertClassifier: logits (B, n_classes), a BertOutput with
        ``return_weights``, or the final hidden states (B, T, d) with ``return_hidden``."""
        cfg, enc = self.config, self.config.encoder
        check_tokens(input_ids, enc.vocab_size, enc.max_len)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = embed_tokens(self, enc, input_ids, positions)  # (B, T, d)
        if cfg.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            else:
                check_tokens(token_type_ids, cfg.type_vocab_size, enc.max_len)
            x = x + self.type_embed(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but config.type_vocab_size=0 (no token-type embeddings)")
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.drop(x)

        mask = key_mask(attention_mask, input_ids.shape)  # (B, 1, 1, T)
        all_w = []
        for layer in self.layers:
            x, _, w = layer(x, mask=mask, positions=positions, return_weights=return_weights)
            all_w.append(w)
        if self.norm is not None:
            x = self.norm(x)
        if return_hidden:
            return x

        pooled = x[:, 0]  # (B, d)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        logits = self.classifier(self.drop(pooled))
        return BertOutput(logits, torch.stack(all_w)) if return_weights else logits

    def encode(self, input_ids, attention_mask=None, token_type_ids=None):
        """Final hidden states (B, T, d)."""
        return self(input_ids, attention_mask, token_type_ids, return_hidden=True)
