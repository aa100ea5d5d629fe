"""OpenAI response bodies from engine outputs: ``ChoiceState`` follows one choice (its text and finish
through its ``stopping.StopChecker``; its ids and log-probabilities), and the functions
below write choices, chunks and log-probabilities in each endpoint's format:

- completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, the
  sampled token always among the alternatives (so up to ``logprobs + 1`` of them, as OpenAI says);
- chat: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}``.

A log-probability of -inf (a token the model rules out) is written as -9999.0, as vLLM does:
JSON has no infinity.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from jaxgpt.inference.protocol import Parsed
from jaxgpt.inference.stopping import StopChecker

NEG = -9999.0


def _lp(x: float) -> float:
    return max(float(x), NEG)


def token_text(tokenizer, i: int) -> str:
    """A token's own text; ``bytes:\\xe2\\x80`` for bytes that are not whole UTF-8 characters
    (OpenAI's form: as '\ufffd' two such tokens would be one key); ``token_id:N`` without a
    tokenizer (vLLM's form)."""
    if tokenizer is None:
        return f"token_id:{i}"
    own = getattr(tokenizer, "token_bytes", None)
    if own is not None:
        b = own(i)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)
    # jaxgpt's own tokenizers (char, BPE) decode special tokens as text already and take no such argument
    if "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters:
        return tokenizer.decode([i], skip_special_tokens=False)
    return tokenizer.decode([i])


def token_bytes(tokenizer, i: int) -> list[int]:
    own = getattr(tokenizer, "token_bytes", None)
    return list(own(i)) if own is not None else list(token_text(tokenizer, i).encode("utf-8"))


@dataclass
class Update:
    """What one engine output added to a choice."""

    ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    text: str
    finish: str | None = None


@dataclass
class ChoiceState:
    index: int
    rid: str
    prompt: list[int]
    stops: StopChecker
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish: str | None = None

    def add(self, out) -> Update:
        """An engine RequestOutput -> the Update. The choice's StopChecker finishes it at the token the
        engine's finishes its request; at a stop string it may be first (the engine sees none), and the
        server then aborts the engine request."""
        tops = getattr(out, "new_top_logprobs", None) or [[] for _ in out.new_token_ids]
        ids, lps, tp, text = [], [], [], ""
        for k, tok in enumerate(out.new_token_ids):
            n = len(self.ids) + k + 1
            delta, reason = self.stops.add(tok, n, len(self.prompt) + n,
                                           final=out.finished and k == len(out.new_token_ids) - 1)
            text += delta
            ids.append(tok)
            lps.append(out.new_logprobs[k] if k < len(out.new_logprobs) else 0.0)
            tp.append(list(tops[k]) if k < len(tops) else [])
            if reason is not None:
                self.finish = reason
                break
        else:
            if out.finished:
                self.finish = out.finish_reason
        self.ids += ids
        self.logprobs += lps
        self.tops += tp
        self.text += text
        return Update(ids, lps, tp, text, self.finish)


def completion_logprobs(tokenizer, u: Update, k: int, offset: int) -> dict:
    """Completions' format for u's tokens; offset: where u's first token starts in the choice's text."""
    tokens = [token_text(tokenizer, i) for i in u.ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    top = []
    for tok, lp, pairs in zip(tokens, u.logprobs, u.tops):
        d = {token_text(tokenizer, j): _lp(x) for j, x in pairs[:k]}
        d.setdefault(tok, _lp(lp))
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [_lp(x) for x in u.logprobs], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, u: Update, k: int) -> dict:
    def entry(i, lp):
        return {"token": token_text(tokenizer, i), "logprob": _lp(lp), "bytes": token_bytes(tokenizer, i)}

    content = [{**entry(i, lp), "top_logprobs": [entry(j, x) for j, x in pairs[:k]]}
               for i, lp, pairs in zip(u.ids, u.logprobs, u.tops)]
    return {"content": content, "refusal": None}


def choice(p: Parsed, tokenizer, c: ChoiceState, u: Update, *, delta: bool, first: bool, offset: int = 0) -> dict:
    """One choice of a response (delta=False, u = the whole choice) or of a stream chunk."""
    out = {"index": c.index, "finish_reason": u.finish}
    if p.kind == "chat":
        msg = {"role": "assistant", "content": u.text} if (first or not delta) else {"content": u.text}
        out["delta" if delta else "message"] = msg
        out["logprobs"] = None if p.logprobs is None else chat_logprobs(tokenizer, u, p.logprobs)
    else:
        out["text"] = u.text
        out["logprobs"] = None if p.logprobs is None else completion_logprobs(tokenizer, u, p.logprobs, offset)
    if p.return_token_ids:
        out["token_ids"] = list(u.ids)
        if first or not delta:
            out["prompt_token_ids"] = list(c.prompt)
    return out
