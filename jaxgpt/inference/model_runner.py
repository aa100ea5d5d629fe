"""A model runner: one model's parameter tree (on the device), its page pools and the compiled paged
forward over them (``paged_model.paged_forward``). The engine holds one for the target model and,
through ``draft_runner.DraftRunner``, one for a draft; the Scheduler decides what rows they run."""
from __future__ import annotations

import jax

from jaxgpt.inference.packed_head import pack_head, resolve_head_kernel
from jaxgpt.inference.paged_cache import init_pools, resolve_paged_kernel
from jaxgpt.inference.paged_model import paged_forward
from jaxgpt.models.decoder import unstack_layers


def device_params(config, params, head_kernel: str):
    """(params, packed head or None) on the device once: host (NumPy) params would be copied into
    every call. A packed head replaces an untied lm_head (the same memory as before)."""
    if head_kernel != "panel":
        return jax.device_put(params), None
    head = jax.device_put(pack_head(config, params))
    if not config.tie_embeddings:
        params = {k: v for k, v in params.items() if k != "lm_head"}
    return jax.device_put(params), head


class ModelRunner:
    """ModelRunner(config, params, num_pages=, page_size=): ``num_pages`` pages of ``page_size`` tokens
    of keys and values in ``kv_dtype``; ``paged_kernel`` (how attention reads the pages) and
    ``head_kernel`` (the vocabulary projection) as the Engine takes them, resolved here. ``params``
    are kept with their layers unstacked (the paged forward's form)."""

    def __init__(self, config, params, *, num_pages: int, page_size: int, kv_dtype: str = "auto",
                 paged_kernel: str = "auto", head_kernel: str = "auto"):
        _, params = unstack_layers(config, params)
        self.config, self.head_kernel = config, resolve_head_kernel(head_kernel, config)
        self.params, self.head = device_params(config, params, self.head_kernel)
        self.pools = init_pools(config, num_pages, page_size, kv_dtype)
        self.kernel = resolve_paged_kernel(paged_kernel, config.dtype, self.pools[0][0].dtype, config.head_dim,
                                           page_size, config.attn_softcap)

    def forward(self, tokens, q_pos, slots, page_table, last):
        """One call over batch_arrays' rows: the pools updated in place -> (greedy next tokens (B,),
        last-token logits (B, V)), on the device."""
        self.pools, tok, logits = paged_forward(self.params, self.pools, tokens, q_pos, slots, page_table, last,
                                                self.head, config=self.config, kernel=self.kernel)
        return tok, logits


__all__ = ["ModelRunner", "device_params"]
