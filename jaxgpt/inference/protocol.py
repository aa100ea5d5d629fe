"""The OpenAI request format: parse and validate a completion body into (prompt ids,
SamplingParams, options), each bad value a 4xx ApiError naming the value and the limit;
incremental detokenization with stop strings; chat templates (jinja2)."""
from __future__ import annotations

from jaxgpt.inference.sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _num(body, key, default, kind, lo=None, lo_open=False, hi=None):
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise ApiError(400, f"{key} must be {'a number' if kind is float else 'an integer'}, got {v!r}", param=key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"{key} must be {'>' if lo_open else '>='} {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"{key} must be <= {hi}, got {v}", param=key)
    return kind(v)


def _prompt_ids(prompt, engine, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = [int(i) for i in tokenizer.encode(prompt)]
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                       param="prompt")
    v, n = engine.config.vocab_size, engine.config.max_len
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    bad = [i for i in ids if not 0 <= i < v]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {v})", param="prompt")
    if len(ids) >= n:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {n} tokens, so a prompt "
                            f"may have at most {n - 1}", param="prompt", code="context_length_exceeded")
    return ids


def parse_completion(body: dict, engine, tokenizer):
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    ids = _prompt_ids(body["prompt"], engine, tokenizer)
    room = engine.config.max_len - len(ids)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = room if max_tokens is None else _num({"max_tokens": max_tokens}, "max_tokens", None, int, lo=1)
    if _num(body, "n", 1, int, lo=1) != 1:
        raise ApiError(400, "n > 1 is not supported; send separate requests", param="n")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    stop_ids = body.get("stop_token_ids") or ()
    if not all(isinstance(i, int) for i in stop_ids):
        raise ApiError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    logprobs = body.get("logprobs")
    seed = body.get("seed")
    seed = 0 if seed is None else _num(body, "seed", 0, int, lo=0)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, float, lo=0.0, hi=100.0),
        top_k=max(0, _num(body, "top_k", 0, int, lo=-1)), top_p=_num(body, "top_p", 1.0, float, lo=0.0, lo_open=True,
                                                                      hi=1.0),
        seed=seed % (2 ** 32), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)), logprobs=bool(logprobs))
    stream_opts = body.get("stream_options") or {}
    opts = dict(stream=bool(body.get("stream", False)), return_token_ids=bool(body.get("return_token_ids", False)),
                logprobs=bool(logprobs), include_usage=bool(stream_opts.get("include_usage", False)))
    return ids, params, opts


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Detokenizer:
    """Text deltas of a growing id list; holds back an incomplete UTF-8 tail ('\\ufffd') and text that
    may be the start of a stop string, and cuts the text at a stop string (OpenAI excludes it)."""

    def __init__(self, tokenizer, stop=()):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, ids, final: bool = False) -> str:
        if self.tok is None or self.stopped:
            self.ids += list(ids)
            return ""
        self.ids += list(ids)
        text = self.tok.decode(self.ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, final, self.stopped = text[:at], True, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # a partial stop string at the end is not sent yet
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        out = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


def render_chat(template: str, messages, tokenizer) -> str:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string content",
                       param="messages")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    specials = {}
    for key in ("bos_token", "eos_token"):
        i = getattr(tokenizer, key.replace("token", "id"), None)
        specials[key] = tokenizer.decode([i], skip_special_tokens=False) if i is not None else ""
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)
