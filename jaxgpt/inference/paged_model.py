"""A DecoderLM over the engine's paged pools: the one forward both the engine's calls
(``engine.paged_forward``) and speculative decoding's rounds (``speculative.speculate``) run."""
from __future__ import annotations

import jax.numpy as jnp

from jaxgpt.inference.packed_head import project
from jaxgpt.inference.sampling import argmax
from jaxgpt.config import Execution
from jaxgpt.models.decoder import DecoderLM
from jaxgpt.nn.kernels.paged import PagedKVCache

SEPARATE = Execution(scan_layers=False)  # the engine's params: separate layers (unstack_layers), read in place


def write_slots(page_table, pos, page_size: int):
    """(B, T) positions (-1 padding) -> flat write slots; padding writes the scratch page 0."""
    page = jnp.take_along_axis(page_table, jnp.maximum(pos, 0) // page_size, axis=1)
    return jnp.where(pos >= 0, page * page_size + pos % page_size, 0)


def paged_apply(config, params, pools, tokens, q_pos, slots, page_table, kernel, logits_at=None, head=None):
    """tokens (B, T) at positions q_pos (-1 padding), their keys/values written to ``slots`` ->
    (logits (B, T, V), or (B, 1, V) at ``logits_at`` (B,); the updated pools; the logits' argmax (B, T)
    or (B, 1)). ``head``: the packed vocabulary projection (packed_head.pack_head) that replaces the
    model's own and gives the argmax in the same pass, or None."""
    caches = tuple(PagedKVCache(k, v, page_table, slots, q_pos, ks, vs, config.dtype, kernel=kernel)
                   for k, v, ks, vs in pools)
    out = DecoderLM(config, SEPARATE).apply({"params": params}, tokens, positions=jnp.maximum(q_pos, 0), cache=caches,
                                  logits_at=logits_at, hidden=head is not None)
    logits, top = (out.logits, argmax(out.logits)) if head is None else project(config, head, out.logits)
    return logits, tuple((c.k, c.v, c.k_scale, c.v_scale) for c in out.cache), top


__all__ = ["paged_apply", "write_slots"]
