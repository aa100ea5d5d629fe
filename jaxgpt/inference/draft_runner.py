"""The draft model of speculative decoding: its own ``ModelRunner``, whose pools hold keys and values
under the target's page ids, filled by the same prefill chunks (``follow``) or by a catch-up after
plain steps, and the speculative round over both models (``speculate``, one program)."""
from __future__ import annotations

import jax
import numpy as np

from jaxgpt.inference import speculative
from jaxgpt.inference.model_runner import ModelRunner


def check_draft(target_config, draft_config, *, max_model_len: int, k: int, budget: int) -> None:
    """Refuse a draft that cannot serve beside the target, naming the value and the limit."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_config.vocab_size}) differs from the target's "
                         f"({target_config.vocab_size}); speculative decoding needs the same one")
    if draft_config.residual != "standard":
        raise ValueError(f"the draft needs a KV cache; residual={draft_config.residual!r} models have none")
    if draft_config.max_len < max_model_len:  # it prefills every prompt the target takes
        raise ValueError(f"the draft's context ({draft_config.max_len}) is shorter than the target's "
                         f"max_model_len ({max_model_len})")
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if k + 1 > budget:
        raise ValueError(f"a speculative row takes num_speculative_tokens + 1 = {k + 1} tokens of "
                         f"max_tokens_per_step={budget}; raise it or lower num_speculative_tokens")


class DraftRunner:
    """DraftRunner(config, params, target_config=, max_model_len=, k=, budget=, **runner): ``k``
    proposals a round; ``runner``: the ModelRunner's keywords (num_pages, page_size, kv_dtype,
    paged_kernel, head_kernel), the target's."""

    def __init__(self, config, params, *, target_config, max_model_len: int, k: int, budget: int, **runner):
        check_draft(target_config, config, max_model_len=max_model_len, k=k, budget=budget)
        self.k = k
        self.model = ModelRunner(config, params, **runner)

    @property
    def config(self):
        return self.model.config

    def follow(self, tokens, q_pos, slots, page_table, last) -> None:
        """Write the keys and values of a call's rows (batch_arrays') into the draft's pools."""
        self.model.forward(tokens, q_pos, slots, page_table, last)

    def wait(self) -> None:
        """Block until the draft's queued calls are done (a wait, no copy)."""
        jax.block_until_ready(self.model.pools)

    def speculate(self, target: ModelRunner, last, pos, page_table, settings):
        """One round for a batch: pending tokens ``last`` (B,) at ``pos`` (B,) (-1: padding row),
        ``settings`` (batch_settings') -> (n accepted (B,), emitted (B, k+1), log-probabilities (B, k+1))
        as NumPy; both models' pools updated in place."""
        d = self.model
        target.pools, d.pools, n, emitted, logp = speculative.speculate(
            target.params, target.pools, d.params, d.pools, last, pos, page_table, *settings, target.head, d.head,
            config=target.config, draft_config=d.config, k=self.k, kernel=target.kernel, draft_kernel=d.kernel)
        return np.asarray(n), np.asarray(emitted), np.asarray(logp)


__all__ = ["DraftRunner", "check_draft"]
