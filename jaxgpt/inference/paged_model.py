"""The one forward over the engine's paged pools: a DecoderLM reading and writing its keys and values
through ``PagedKVCache``. The engine's calls (``paged_forward``, its jitted program) and speculative
decoding's rounds (``speculative.speculate``, traced inside its own program) both run ``paged_apply``."""
from __future__ import annotations

from functools import partial

import jax
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


def paged_apply(params, pools, tokens, q_pos, slots, page_table, logits_at=None, head=None, *, config,
                kernel="gather"):
    """tokens (B, T) at positions q_pos (-1 padding), their keys/values written to ``slots`` (None: derived
    from q_pos and the page table) -> (the updated pools, the logits' argmax, the logits).

    Without ``logits_at`` the argmax is (B, T) and the logits (B, T, V); with ``logits_at`` (B,) (one
    position a row) they are (B,) and (B, V). ``head``: the packed vocabulary projection
    (packed_head.pack_head) that replaces the model's own and gives the argmax in the same pass, or None.
    """
    if slots is None:
        slots = write_slots(page_table, q_pos, pools[0][0].shape[2])
    caches = tuple(PagedKVCache(k, v, page_table, slots, q_pos, ks, vs, config.dtype, kernel=kernel)
                   for k, v, ks, vs in pools)
    out = DecoderLM(config, SEPARATE).apply({"params": params}, tokens, positions=jnp.maximum(q_pos, 0), cache=caches,
                                  logits_at=logits_at, hidden=head is not None)
    logits, top = (out.logits, argmax(out.logits)) if head is None else project(config, head, out.hidden)
    pools = tuple((c.k, c.v, c.k_scale, c.v_scale) for c in out.cache)
    if logits_at is not None:
        return pools, top[:, 0], logits[:, 0]  # (B,), (B, V)
    return pools, top, logits


# One engine call as a program: the pools are donated (updated in place). Sampling is a second program
# (``sampling.sample``), run only when a row samples, wants logprobs or has a bias or penalties: its sort
# would otherwise enter every (B, T, P) shape's compilation, and it depends on B alone.
paged_forward = partial(jax.jit, static_argnames=("config", "kernel"), donate_argnums=(1,))(paged_apply)


__all__ = ["paged_apply", "paged_forward", "write_slots"]
