"""When a request stops: the one place its stop conditions are decided.

In order: an end-of-sequence token (unless ``ignore_eos``), one of ``stop_token_ids``, a stop string
(seen by an incremental ``detokenize.Detokenizer``: O(1) decoding a token), then ``max_tokens`` or
the context window ("length"). The engine keeps a ``StopChecker`` per request; the server keeps one
per choice for the choice's text and stop strings (it decodes off the engine thread and aborts the
engine request at a stop string), so both finish a request at the same token for the same reason.
"""
from __future__ import annotations

from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.sampling import SamplingParams


class StopChecker:
    """One request's stop conditions. ``eos_ids``: end-of-sequence tokens; ``max_model_len``: the
    context window (None: unchecked); ``detok``: the request's Detokenizer, whose stop strings count
    (None: no text, no stop strings)."""

    def __init__(self, params: SamplingParams, *, eos_ids=frozenset(), max_model_len: int | None = None,
                 detok: Detokenizer | None = None):
        self.params, self.eos_ids, self.max_model_len, self.detok = params, eos_ids, max_model_len, detok

    def add(self, tok: int, n_output: int, n_tokens: int, final: bool = False) -> tuple[str, str | None]:
        """The new token ``tok``, making ``n_output`` output and ``n_tokens`` tokens in all ->
        (its text, cut before a stop string; the finish reason or None). ``final``: the request's last token."""
        text = "" if self.detok is None else self.detok.add([tok], final=final)
        return text, self.reason(tok, n_output, n_tokens)

    def reason(self, tok: int, n_output: int, n_tokens: int) -> str | None:
        p = self.params
        if not p.ignore_eos and tok in self.eos_ids or tok in p.stop_token_ids:
            return "stop"
        if self.detok is not None and self.detok.stopped:
            return "stop"
        if n_output >= p.max_tokens or self.max_model_len is not None and n_tokens >= self.max_model_len:
            return "length"
        return None


__all__ = ["StopChecker"]
