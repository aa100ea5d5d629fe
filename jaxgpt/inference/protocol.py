"""The OpenAI request format: a /v1/completions or /v1/chat/completions body -> ``Parsed`` (prompt
ids, one SamplingParams per choice, how to answer). Every field is honoured or refused with a 400
that names it: unknown fields as OpenAI does ("Unrecognized request argument supplied: X"), OpenAI
fields this server does not implement unless null. Defaults and ranges follow the OpenAI API
reference (``max_tokens`` 16 on completions, the rest of the context on chat; temperature 0..2).
Stop strings stay with the server: each choice's ``stopping.StopChecker`` decodes its text off the engine
thread and the server aborts the engine request at one.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxgpt.inference.chat_template import chat_prompt_ids
from jaxgpt.inference.errors import ApiError
from jaxgpt.inference.sampling import SamplingParams

MAX_CHOICES = 128  # n x prompts: each choice is an engine request
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_LOGPROBS = {"completion": 5, "chat": 20}  # logprobs (completions) / top_logprobs (chat)
SEEDS = 2 ** 32

EXTENSIONS = {"ignore_eos", "top_k", "stop_token_ids", "return_token_ids"}  # vLLM's, documented in serving.md
COMMON = {"model", "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", "n", "seed", "stop", "stream",
          "stream_options", "temperature", "top_p", "user"} | EXTENSIONS
# OpenAI fields this server does not implement: a 400 naming them, unless null / empty / false
# (tool_choice also 'none'), which ask for nothing
UNSUPPORTED = {
    "completion": {"suffix": "suffix (insertion) is not supported by this server"},
    "chat": {k: f"{k} is not supported by this server (no tool calling)"
             for k in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")}
    | {k: f"{k} is not supported by this server" for k in (
        "audio", "modalities", "prediction", "reasoning_effort", "store", "metadata", "service_tier",
        "web_search_options")},
}
FIELDS = {"completion": COMMON | {"prompt", "best_of", "echo", "logprobs"} | set(UNSUPPORTED["completion"]),
          "chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
          | set(UNSUPPORTED["chat"])}


@dataclass
class Parsed:
    """A request, ready for the engine: choice c answers prompts[c // n] with params[c] (prompt-major,
    as OpenAI indexes a batch's choices)."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    stop: tuple[str, ...]  # decided by each choice's StopChecker in the server, not sent to the engine
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none; else how many alternatives per token (completions: logprobs)
    echo: bool = False
    return_token_ids: bool = False
    user: str | None = None


def _num(body, key, default, kind, lo=None, lo_open=False, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise ApiError(400, f"{key} must be {'a number' if kind is float else 'an integer'}, got {v!r}", param=key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"{key} must be {'>' if lo_open else '>='} {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"{key} must be <= {hi}, got {v}", param=key)
    return kind(v)


def _bool(body, key) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{key} must be true or false, got {v!r}", param=key)
    return bool(v)


def check_fields(body: dict, kind: str) -> None:
    for key in body:
        if key not in FIELDS[kind]:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=key)
        v = body[key]
        unset = v is None or v is False or v == [] or v == {} or (key == "tool_choice" and v == "none")
        if key in UNSUPPORTED[kind] and not unset:
            raise ApiError(400, UNSUPPORTED[kind][key], param=key)


def _check_ids(ids: list[int], engine, param: str) -> list[int]:
    v, n = engine.config.token_vocab, context(engine)  # a padded table's extra rows are no tokens
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param)
    bad = [i for i in ids if not 0 <= i < v]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {v})", param=param)
    if len(ids) >= n:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {n} tokens, so a prompt "
                            f"may have at most {n - 1}", param=param, code="context_length_exceeded")
    return ids


def context(engine) -> int:
    return engine.max_model_len  # --max-model-len, else the model's context


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def encode_text(text: str, tokenizer, param: str) -> list[int]:
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param=param)
    try:
        return [int(i) for i in tokenizer.encode(text)]
    except ValueError as e:  # a character outside a character vocabulary, a run without a tokenizer
        raise ApiError(400, f"the prompt cannot be tokenized: {e}", param=param) from None


def prompt_ids(prompt, engine, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of ids, a list of id lists."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)):
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                            "token ids (non-empty)", param="prompt")
    return [_check_ids(encode_text(p, tokenizer, "prompt") if isinstance(p, str) else list(p), engine, "prompt")
            for p in prompt]


def _stop(body, vocab: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {body.get('stop')!r}",
                       param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not _is_ids(ids) or not all(0 <= i < vocab for i in ids):
        raise ApiError(400, f"stop_token_ids must be a list of token ids in [0, {vocab}), got {ids!r}",
                       param="stop_token_ids")
    return tuple(stop), tuple(ids)


def _logit_bias(body, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, f"logit_bias must be an object mapping token ids to numbers, got {bias!r}",
                       param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            i = int(key)
        except ValueError:
            i = -1
        if not 0 <= i < vocab:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab})", param="logit_bias")
        if i in out:  # '1' and '01' both read as 1
            raise ApiError(400, f"logit_bias names token id {i} twice", param="logit_bias")
        out[i] = _num({"logit_bias": value}, "logit_bias", 0.0, float, lo=-100.0, hi=100.0)
    return tuple(sorted(out.items()))


def _sampling(body: dict, kind: str, prompts: list[list[int]], n: int, engine, top: int, logprobs: bool):
    """One SamplingParams per choice, and the stop strings."""
    vocab, ctx = engine.config.token_vocab, context(engine)
    key = "max_tokens"
    max_tokens = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != body["max_completion_tokens"]:
            raise ApiError(400, "give max_completion_tokens or max_tokens (deprecated), not both",
                           param="max_completion_tokens")
        key, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is not None:
        max_tokens = _num({key: max_tokens}, key, None, int, lo=1)
    elif kind == "completion":
        max_tokens = 16  # OpenAI's default on /v1/completions
    for p in prompts:
        room = ctx - len(p)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"this model's context is {ctx} tokens, but {len(p) + max_tokens} were requested "
                                f"({len(p)} in the prompt, {max_tokens} for the completion); lower {key} to at most "
                                f"{room}", param=key, code="context_length_exceeded")
    stop, stop_ids = _stop(body, vocab)
    seed = body.get("seed")
    if seed is not None:
        seed = _num(body, "seed", None, int, lo=-2 ** 63, hi=2 ** 64 - 1)
    extra = dict(presence_penalty=_num(body, "presence_penalty", 0.0, float, lo=-2.0, hi=2.0),
                 frequency_penalty=_num(body, "frequency_penalty", 0.0, float, lo=-2.0, hi=2.0),
                 logit_bias=_logit_bias(body, vocab), top_logprobs=top)
    top_k = _num(body, "top_k", 0, int, lo=-1)  # vLLM: -1 = off
    top_k = 0 if top_k >= vocab else max(0, top_k)  # k >= the vocabulary keeps every token (and k fits int32)
    base = dict(temperature=_num(body, "temperature", 1.0, float, lo=0.0, hi=2.0), top_k=top_k,
                top_p=_num(body, "top_p", 1.0, float, lo=0.0, lo_open=True, hi=1.0), stop_token_ids=stop_ids,
                ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs, **extra)
    params = []
    for c in range(len(prompts) * n):
        # choice c of a seeded request uses seed + c: choices differ, and the request repeats;
        # an unseeded one gets fresh entropy for each choice (None: the engine draws it)
        s = None if seed is None else (seed + c) % SEEDS
        mt = ctx - len(prompts[c // n]) if max_tokens is None else max_tokens
        params.append(SamplingParams(max_tokens=mt, seed=s, **base))
    return params, stop


def _n(body, kind: str, n_prompts: int) -> int:
    n = _num(body, "n", 1, int, lo=1)
    if kind == "completion" and body.get("best_of") is not None:
        best_of = _num(body, "best_of", 1, int, lo=1)
        if best_of != n:
            raise ApiError(400, f"best_of={best_of} must equal n={n}: this server returns every choice it generates "
                                "(it does not rank candidates)", param="best_of")
    if n * n_prompts > MAX_CHOICES:
        raise ApiError(400, f"n x prompts = {n} x {n_prompts} = {n * n_prompts} choices; at most {MAX_CHOICES} a "
                            "request", param="n")
    return n


def _stream(body) -> tuple[bool, bool]:
    stream, opts = _bool(body, "stream"), body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise ApiError(400, f"stream_options takes include_usage only, got {opts!r}", param="stream_options")
    return stream, _bool({"stream_options.include_usage": opts.get("include_usage")},
                         "stream_options.include_usage")


def _user(body) -> str | None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {user!r}", param="user")
    return user


def parse_completion(body: dict, engine, tokenizer) -> Parsed:
    check_fields(body, "completion")
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    prompts = prompt_ids(body["prompt"], engine, tokenizer)
    n = _n(body, "completion", len(prompts))
    top = _num(body, "logprobs", None, int, lo=0, hi=MAX_LOGPROBS["completion"])
    echo = _bool(body, "echo")
    if echo and top is not None:
        raise ApiError(400, "echo with logprobs is not supported: the engine computes no log-probabilities for "
                            "prompt tokens", param="echo")
    if echo and tokenizer is None:
        raise ApiError(400, "echo needs the model's tokenizer (the prompt's text); this model has none", param="echo")
    params, stop = _sampling(body, "completion", prompts, n, engine, top or 0, top is not None)
    if stop and tokenizer is None:
        raise ApiError(400, "stop strings need the model's tokenizer; this model has none: use stop_token_ids",
                       param="stop")
    stream, usage_ = _stream(body)
    return Parsed("completion", prompts, params, n, stop, stream, usage_, top, echo, _bool(body, "return_token_ids"),
                  _user(body))


def parse_chat(body: dict, engine, tokenizer, template: str) -> Parsed:
    check_fields(body, "chat")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, f"response_format {fmt!r} is not supported (only {{'type': 'text'}}; no JSON mode)",
                       param="response_format")
    prompts = [_check_ids(chat_prompt_ids(template, body.get("messages"), tokenizer), engine, "messages")]
    n = _n(body, "chat", 1)
    logprobs = _bool(body, "logprobs")
    top = _num(body, "top_logprobs", None, int, lo=0, hi=MAX_LOGPROBS["chat"])
    if top is not None and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params, stop = _sampling(body, "chat", prompts, n, engine, top or 0, logprobs)
    stream, usage_ = _stream(body)
    return Parsed("chat", prompts, params, n, stop, stream, usage_, (top or 0) if logprobs else None, False,
                  _bool(body, "return_token_ids"), _user(body))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
