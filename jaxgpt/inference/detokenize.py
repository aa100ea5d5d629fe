"""Incremental detokenization with stop strings: O(1) decoding work per token.

Decoding the whole id list again for every new token costs O(n) a token, O(n^2) a stream, and
stalls every row of the batch when it runs on the engine thread. This decodes a small window of
recent ids instead, as vLLM's ``detokenize_incrementally`` and HF's ``TextStreamer`` do:

* ``ids[prefix:read]`` is text already taken, kept as context (a SentencePiece decoder drops the
  leading space of the first token it sees, so a token is never decoded alone); ``ids[prefix:]``
  decoded, minus that context's text, is the new text.
* The window moves on (``prefix = read; read = len(ids)``; the context stays if the new ids
  decode to nothing, as skipped special tokens do) only when its text does not end in
  '\\ufffd': then the decoder stands between two whole characters, so decoding from there gives
  what a decode of the whole list gives from there. A byte-level BPE token may end inside a
  multi-byte character (emoji, CJK); until the next token completes it, the window grows.
  Characters before a trailing '\\ufffd' are final, so they are taken at once; the '\\ufffd' tail
  waits (``final=True`` flushes it as it is: invalid bytes stay '\\ufffd', as in a full decode).
* Taken text is held back while its end may be the start of a stop string; a stop string cuts
  the text before it (OpenAI excludes it), even when it spans tokens. The held text is shorter
  than the longest stop string, so the search per token is O(1) too.

The concatenated deltas equal ``tokenizer.decode(ids)`` for decoders whose output past a character
boundary depends on what comes before it at most through "is this the first text" (byte-level
BPE, SentencePiece's Metaspace with byte fallback, character vocabularies;
parity_tests/engine/test_detokenize.py checks all three on random id streams).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Text deltas of a growing id list: ``add(ids, final=False) -> str``; ``stopped`` once a stop
    string was seen (later ids are recorded, no text returned); ``ids`` every id added."""

    def __init__(self, tokenizer, stop=()):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.stopped = False
        self._prefix = self._read = 0  # the window: context ids[prefix:read], new ids[read:]
        self._prefix_len = 0  # len(decode(ids[prefix:read]))
        self._taken = 0  # chars of the window's new text already taken
        self._pending = ""  # taken text not returned yet: a possible stop-string start

    def add(self, ids, final: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self.tok is None or self.stopped:
            self.ids += ids
            return ""
        if final and not self.ids:  # all at once (a response that is not streamed): one decode
            self.ids = ids
            self._pending = self._decode(0, len(ids))
            return self._release(final=True)
        for i in ids:  # one at a time: a window never spans more than one unfinished character's ids
            self.ids.append(i)
            self._take(final=False)
        if final:
            self._take(final=True)
        return self._release(final)

    def _decode(self, lo: int, hi: int) -> str:
        return self.tok.decode(self.ids[lo:hi]) if hi > lo else ""

    def _take(self, final: bool) -> None:
        text = self._decode(self._prefix, len(self.ids))
        clean = final or not text.endswith(REPLACEMENT)
        end = len(text) if clean else len(text.rstrip(REPLACEMENT))
        start = self._prefix_len + self._taken
        if end > start:
            self._pending += text[start:end]
            self._taken = end - self._prefix_len
        if clean and not final:
            n = len(self._decode(self._read, len(self.ids)))
            if n:  # the new ids become the context
                self._prefix, self._prefix_len = self._read, n
            else:  # they decode to nothing (skipped special tokens): keep the old context with them
                self._prefix_len = len(text)
            self._read, self._taken = len(self.ids), 0

    def _release(self, final: bool) -> str:
        text = self._pending
        cuts = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if cuts:
            self.stopped, self._pending = True, ""
            return text[:min(cuts)]
        hold = 0 if final else max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                                    if text.endswith(s[:k])), default=0)
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]
