"""Decoder-only language model mirroring jaxgpt/models/decoder.py (tok_embed, pos_embed,
layers.{i}, norm, lm_head)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from jaxgpt.config import ModelConfig
from torch_ref.nn.attention import KVCache
from torch_ref.nn.block import Block
from torch_ref.nn.norms import norm_from_config
from torch_ref.nn.softcap import softcap
from torch_ref.models.stack import add_embeddings, check_tokens, embed_tokens


class DecoderOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, vocab)
    cache: list | None  # one KVCache per layer
    attn_weights: torch.Tensor | None  # (L, B, H, T, S)
    depth_weights: torch.Tensor | None = None  # AttnRes: (Q, B, T, N_max), as jaxgpt's


def init_cache(config: ModelConfig, batch: int, max_len: int | None = None, dtype=torch.float32, device=None):
    """One empty KVCache per layer, each (B, H_kv, max_len, D)."""
    s = config.max_len if max_len is None else max_len
    return [KVCache.init(batch, config.kv_heads, s, config.head_dim, dtype, device) for _ in range(config.n_layer)]


class DecoderLM(nn.Module):
    """Causal language model. ``model(tokens)`` -> logits (B, T, vocab)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        add_embeddings(self, cfg)
        if cfg.residual == "standard":
            self.layers = nn.ModuleList(Block(cfg, sparse=cfg.sparse_layer(i)) for i in range(cfg.n_layer))
        else:
            from torch_ref.nn.attnres import AttnResLayers

            self.layers = AttnResLayers(cfg)
        self.norm = norm_from_config(cfg) if cfg.final_norm else None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
            if cfg.lm_head_bias:
                nn.init.zeros_(self.lm_head.bias)

    def forward(self, tokens, *, positions=None, cache=None, mask=None, return_weights=False,
                return_depth_weights=False, segment_ids=None):
        """Same contract as jaxgpt's DecoderLM: logits, or a DecoderOutput with a cache / weights."""
        cfg = self.config
        offset = 0 if cache is None else cache[0].index
        check_tokens(tokens, cfg.token_vocab, cfg.max_len, offset)
        if positions is None:
            positions = offset + torch.arange(tokens.shape[-1], device=tokens.device)
        x = embed_tokens(self, cfg, tokens, positions)
        weights = depth = None
        if return_depth_weights and cfg.residual == "standard":
            raise ValueError("return_depth_weights: a residual='standard' model has no depth attention "
                             "(residual='full_attnres' or 'block_attnres' have)")
        if cfg.residual == "standard":
            new_cache, all_w = [], []
            for i, layer in enumerate(self.layers):
                x, c, w = layer(x, mask=mask, positions=positions, cache=None if cache is None else cache[i],
                                return_weights=return_weights, segment_ids=segment_ids, window=cfg.layer_window(i))
                new_cache.append(c)
                all_w.append(w)
            cache = None if cache is None else new_cache
            weights = torch.stack(all_w) if return_weights else None
        else:
            if cache is not None:
                raise ValueError(f"residual={cfg.residual!r} does not support a KV cache; decode without one")
            x, weights, *depth = self.layers(x, mask=mask, positions=positions, return_weights=return_weights,
                                             return_depth_weights=return_depth_weights, segment_ids=segment_ids)
            depth = depth[0] if depth else None
        if self.norm is not None:
            x = self.norm(x)
        logits = x @ self.tok_embed.weight.T if cfg.tie_embeddings else self.lm_head(x)
        logits = softcap(logits, cfg.logit_softcap)
        if cfg.valid_vocab is not None:  # padded ids: the float32 minimum, as jaxgpt's mask_padded_vocab
            padded = torch.arange(logits.shape[-1], device=logits.device) >= cfg.valid_vocab
            logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
        if cache is None and not return_weights and not return_depth_weights:
            return logits
        return DecoderOutput(logits, cache, weights, depth)
