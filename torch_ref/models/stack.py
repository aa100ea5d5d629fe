"""Mirror of jaxgpt/models/stack.py: what every model shares around its Blocks (token checks,
embeddings). The Blocks themselves run in each model's own loop (eager torch needs no scan)."""
from __future__ import annotations

import math

import torch
from torch import nn

from jaxgpt.core import validate
from jaxgpt.config import ModelConfig
from torch_ref.nn.positions import sinusoidal_table


def check_tokens(tokens: torch.Tensor, vocab_size: int, max_len: int, offset: int = 0) -> None:
    """Raise ValueError for ids outside [0, vocab_size) or sequences past the context window."""
    t = tokens.shape[-1]
    if offset + t > max_len:
        raise ValueError(f"{t} tokens after {offset} cached positions exceed max_len={max_len}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        validate.check_ids(tokens.cpu().numpy(), vocab_size)  # the same message as jaxgpt, with the position


def add_embeddings(module: nn.Module, config: ModelConfig) -> None:
    """Give ``module`` tok_embed (+ pos_embed or a sinusoidal buffer) and an embedding dropout,
    the attribute names jaxgpt's embed_tokens uses."""
    cfg = config
    module.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)  # no grad in that row
    nn.init.normal_(module.tok_embed.weight, std=cfg.init_std)
    if cfg.pos == "learned":
        module.pos_embed = nn.Embedding(cfg.max_len, cfg.d_model)
        nn.init.normal_(module.pos_embed.weight, std=cfg.init_std)
    elif cfg.pos == "sinusoidal":
        module.register_buffer("pos_table", sinusoidal_table(cfg.max_len, cfg.d_model), persistent=False)
    module.embed_drop = nn.Dropout(cfg.dropout)


def embed_tokens(module: nn.Module, config: ModelConfig, tokens, positions):
    """Token (+ absolute position) embeddings with dropout, from add_embeddings' attributes."""
    x = module.tok_embed(tokens)
    if config.embed_scale:
        x = x * math.sqrt(config.d_model)
    if config.pos == "learned":
        x = x + module.pos_embed(positions)
    elif config.pos == "sinusoidal":
        x = x + module.pos_table[positions]
    return module.embed_drop(x)
