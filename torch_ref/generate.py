"""Autoregressive decoding mirroring jaxgpt/inference/generate.py: prefill, then one token per step through
the per-layer KV caches; an uncached path recomputes the window (cropped to max_len)."""
from __future__ import annotations

import torch

from jaxgpt.config import check_sampling
from torch_ref.models.decoder import DecoderLM, init_cache


def sample_logits(logits, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None):
    """Next tokens (B,) from logits (B, V); temperature 0 is greedy. Same filtering as jaxgpt
    (torch draws its own random numbers, so only greedy decoding matches token for token)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    neg = torch.finfo(torch.float32).min
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg)
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), neg)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: DecoderLM, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             use_cache: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``prompt`` (B, T0) by ``max_new_tokens`` tokens -> (B, T0 + max_new_tokens)."""
    cfg = model.config
    if prompt.dim() != 2 or prompt.shape[1] == 0:  # the same argument errors as jaxgpt's generate
        raise ValueError(f"prompt must be (batch, length>=1) token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
    was_training = model.training
    model.eval()
    b, t0 = prompt.shape
    fits = t0 + max_new_tokens <= cfg.max_len
    sample = lambda lg: sample_logits(lg, temperature=temperature, top_k=top_k, top_p=top_p,
                                      generator=generator)
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    tokens = prompt
    if use_cache and fits and cfg.residual == "standard":
        out = model(prompt, cache=init_cache(cfg, b, t0 + max_new_tokens, device=prompt.device))
        logits, cache = out.logits[:, -1], out.cache
    else:
        logits, cache = model(prompt)[:, -1], None
    for i in range(max_new_tokens):
        tok = sample(logits)
        if eos_id is not None:
            tok = tok.masked_fill(done, eos_id)
            done = done | (tok == eos_id)
        tokens = torch.cat([tokens, tok[:, None]], 1)
        if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            continue
        if cache is not None:
            out = model(tok[:, None], cache=cache)
            logits, cache = out.logits[:, -1], out.cache
        else:
            logits = model(tokens[:, -cfg.max_len:])[:, -1]
    if eos_id is not None and tokens.shape[1] < t0 + max_new_tokens:
        tokens = torch.cat([tokens, tokens.new_full((b, t0 + max_new_tokens - tokens.shape[1]), eos_id)], 1)
    model.train(was_training)
    return tokens
