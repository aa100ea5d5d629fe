"""A fuzzer over ``jaxgpt serve``'s request schemas (hypothesis): /v1/completions and
/v1/chat/completions bodies with arbitrary JSON in every field, wrong types, huge and negative
numbers (also as raw JSON text: 5,000-digit integers, 1e999, NaN), unicode edge cases (lone
surrogates, byte-order marks, combining marks, 5,000-character strings), duplicate keys, bodies
nested up to 100,000 deep, truncated or flipped bytes and random bytes. For each request: a 2xx,
or a 4xx with OpenAI's error body, never a 5xx (a stream must end with ``[DONE]``, never an error
event); no log record with a traceback or at ERROR; every KV page free afterwards. After the run the
server answers a known greedy request with the tokens jaxgpt's own ``generate`` gives (a reference
the server did not compute).

The app runs in-process (httpx's ASGITransport) over a tiny decoder with a byte-level BPE tokenizer
trained here, so an example takes milliseconds. The fast tier runs 200 derandomized examples (the
same ones every run); the slow tier 2,000. ``JAXGPT_FUZZ_EXAMPLES=N`` runs N random examples instead
(``--hypothesis-seed=S`` repeats a run); a failure prints the falsifying request and a
``@reproduce_failure`` line.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require_module

require_module("fastapi", allow_module_level=True)
try:  # the openai client's HTTP package: httpx2 in the versions that renamed it
    import httpx2 as httpx
except ImportError:
    httpx = require_module("httpx", allow_module_level=True)

from jaxgpt.inference.chat_template import ROLES  # noqa: E402  (after the dependency check)
from jaxgpt.inference.protocol import FIELDS  # noqa: E402

NAME = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
CTX = 64
KNOWN = {"model": NAME, "prompt": "the cat sat", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}
_EXPLORE = "JAXGPT_FUZZ_EXAMPLES" in os.environ


def tiny_engine(**kw):
    """(engine, tokenizer, config, params): a one-layer decoder over a byte-level BPE vocabulary
    (any text encodes), every engine shape compiled."""
    from jaxgpt.config import ModelConfig
    from jaxgpt.data.tokenizers import train_bpe
    from jaxgpt.inference.engine import Engine
    from jaxgpt.models import init_params

    tok = train_bpe("the cat sat on the mat. the dog sat on the log. a cat and a dog met.\n" * 20, 300,
                    special_tokens=("<|endoftext|>",))
    config = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, max_len=CTX, pos="rope")
    params = init_params(config, jax.random.PRNGKey(0))
    engine = Engine(config, params, **{"max_seqs": 4, "page_size": 16, "max_tokens_per_step": 32, **kw})
    engine.precompile()
    return engine, tok, config, params


class Records(logging.Handler):
    """Every log record while installed on the root logger; ``bad()``: those with a traceback or at
    ERROR and above."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def bad(self, since: int = 0) -> list[str]:
        return [f"{r.name} {r.levelname}: {r.getMessage()[:300]}" for r in self.records[since:]
                if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]


def pages_free(engine, wait: float = 3.0) -> bool:
    end = time.perf_counter() + wait
    while time.perf_counter() < end:
        if engine.allocator.free == engine.allocator.total and not engine.has_unfinished():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def fuzz_server():
    from jaxgpt.inference.generate import generate
    from jaxgpt.inference.server import create_app

    engine, tok, config, params = tiny_engine()
    app = create_app(engine, tokenizer=tok, model_name=NAME, chat_template=TEMPLATE)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    ids = [int(i) for i in tok.encode(KNOWN["prompt"])]
    ref = np.asarray(generate(config, params, [ids], KNOWN["max_tokens"]))[0, len(ids):].tolist()
    yield engine, loop, client, ref
    loop.run_until_complete(client.aclose())
    app.state.engine_loop().close()
    loop.close()


# -- the requests ------------------------------------------------------------------------------------
class Raw(str):
    """JSON text written into the body as it is (what json.dumps cannot write: 5,000-digit numbers,
    deep nesting)."""


class Obj(list):
    """A JSON object as (key, value) pairs: keys may repeat."""


def dumps(v) -> str:
    """JSON text with ASCII escapes (lone surrogates survive), NaN/Infinity written as Python does."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(x)}" for k, x in v) + "}"
    if isinstance(v, dict):
        return dumps(Obj(v.items()))
    if isinstance(v, list):
        return "[" + ",".join(dumps(x) for x in v) + "]"
    return json.dumps(v)


VOCAB = 300  # tiny_engine's BPE has at most this many tokens: ids around it are in and out of the vocabulary
chars = st.characters(exclude_categories=())  # every code point, lone surrogates included
EDGE_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "\udfff", "\ud83d\ude00", "\U0001f600", "\u202e", "\ufeff",
                             "e\u0301", "\uffff", "\U0010ffff", "caf\u00e9", "<|endoftext|>", "{{ 7 * 7 }}",
                             "{% raw %}", "\r\n\t", "a" * 5000, "\u00e9" * 3000])
EDGE_NUMBERS = st.sampled_from([0, -1, 1, 2, 63, 64, 128, 129, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, -2 ** 63 - 1,
                                10 ** 30, 0.5, -0.0, 1e-300, 1e300, -1e300, True, False])
RAW_NUMBERS = st.sampled_from(["1" * 5000, "-" + "9" * 4400, "1e999", "-1e999", "1e-999", "NaN", "Infinity",
                               "-Infinity", "0.0000000000000000000000001", "1E2", "-0"]).map(Raw)
surrogates = st.text(st.sampled_from("a \ud800\udbff\udc00\udfff\U0001f600\u00e9\x00"), max_size=4)  # halves, pairs
texts = st.one_of(st.text(chars, max_size=12), EDGE_TEXT, surrogates)
numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), EDGE_NUMBERS, RAW_NUMBERS)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
anything = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                     st.dictionaries(texts, c, max_size=3)), max_leaves=8)


@st.composite
def nested(draw):
    """A value nested up to 100,000 deep: arrays, objects, or both."""
    depth = draw(st.one_of(st.integers(1, 40), st.sampled_from([100, 1000, 5000, 100_000])))
    kind = draw(st.sampled_from(["[", '{"a":', "mix"]))
    opens = [kind if kind != "mix" else ("[" if i % 2 else '{"a":') for i in range(depth)]
    return Raw("".join(opens) + "1" + "".join("]" if o == "[" else "}" for o in reversed(opens)))


token_ids = st.lists(st.one_of(st.integers(-2, VOCAB + 2), EDGE_NUMBERS), max_size=12)
small_ints = st.one_of(st.integers(-3, 8), EDGE_NUMBERS)
floats = st.one_of(st.floats(-3, 3), EDGE_NUMBERS, RAW_NUMBERS)
parts = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                  st.dictionaries(st.sampled_from(["type", "text", "image_url"]), anything, max_size=3))
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts}),
                    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES + ("tool", "")), anything),
                                           "content": st.one_of(texts, st.lists(parts, max_size=3), anything)},
                                          optional={"name": anything, "tool_calls": anything}),
                    anything)
# token ids written several ways (int() reads them all), so that two keys may name one id
bias_keys = st.one_of(st.sampled_from(["0", "00", "+0", " 0", "1", "01", " 1", "+1", "\u0661", "1_0", "10", "-1",
                                       "9" * 30, "1.5", "", "0x1"]), st.integers(-2, VOCAB + 2).map(str), texts)
PLAUSIBLE = {
    "prompt": st.one_of(texts, st.lists(texts, max_size=4), token_ids, st.lists(token_ids, max_size=3)),
    "messages": st.lists(message, max_size=4),
    "n": small_ints, "best_of": small_ints, "max_tokens": small_ints, "max_completion_tokens": small_ints,
    "top_k": st.one_of(st.integers(-3, VOCAB + 5), EDGE_NUMBERS), "logprobs": st.one_of(st.booleans(), small_ints),
    "top_logprobs": st.one_of(st.integers(-1, 25), EDGE_NUMBERS), "seed": numbers,
    "temperature": floats, "top_p": floats, "presence_penalty": floats, "frequency_penalty": floats,
    "stop": st.one_of(texts, st.lists(texts, max_size=6)), "stop_token_ids": token_ids,
    "logit_bias": st.lists(st.tuples(bias_keys, st.one_of(st.floats(-100, 100), floats)), max_size=4).map(Obj),
    "stream": st.booleans(), "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                                         anything),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "user": texts,
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), anything),
    "model": st.one_of(st.just(NAME), texts),
}
words = st.text("abcdefghijklmnopqrstuvwxyz .<>", min_size=1, max_size=8)
id_list = st.lists(st.integers(0, 250), min_size=1, max_size=6)
# values in range, so that many requests are answered (streams too) and not only refused
VALID = {
    "prompt": st.one_of(words, st.lists(words, min_size=1, max_size=3), id_list),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": words}), min_size=1,
                         max_size=3),
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8),
    "top_k": st.integers(-1, 50), "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5), "seed": st.integers(0, 2 ** 32), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.1, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "stop": st.one_of(words, st.lists(words, max_size=4)), "stop_token_ids": st.lists(st.integers(0, 250), max_size=3),
    "logit_bias": st.dictionaries(st.tuples(st.sampled_from(["", "0", "+", " "]), st.integers(0, 3)).map(
        lambda t: t[0] + str(t[1])), st.floats(-100, 100), max_size=3),  # '1' and '01' name one token
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "echo": st.booleans(), "user": words, "response_format": st.just({"type": "text"}),
}
FIELD_NAMES = sorted(FIELDS["completion"] | FIELDS["chat"]) + ["bogus", "", "\ud800", "Prompt"]


@st.composite
def fields_body(draw, kind):
    """A valid small body, then fields set to plausible or arbitrary values (keys may repeat)."""
    base = [("model", NAME), ("max_tokens", 2)]
    if draw(st.booleans()):  # half the requests stream
        base += [("stream", True)] + ([("stream_options", {"include_usage": True})] if draw(st.booleans()) else [])
    base.append(("prompt", "the cat") if kind == "completion" else ("messages", [{"role": "user", "content": "hi"}]))
    pairs = Obj(base)
    names = st.sampled_from(FIELD_NAMES if draw(st.integers(0, 4)) == 0 else sorted(FIELDS[kind]))
    for key in draw(st.lists(names, max_size=5)):
        pick = draw(st.integers(0, 9))  # a value in range (half the time), plausible, arbitrary, or deep
        value = draw(VALID.get(key, anything) if pick < 5 else PLAUSIBLE.get(key, anything) if pick < 8
                     else anything if pick < 9 else nested())
        if draw(st.booleans()):  # replace the field (the usual case) or repeat the key
            pairs[:] = [(k, v) for k, v in pairs if k != key]
        pairs.append((key, value))
    if draw(st.integers(0, 9)) == 0:  # a field left out (the prompt or messages too)
        pairs.pop(draw(st.integers(0, len(pairs) - 1)))
    return dumps(pairs).encode("ascii")


@st.composite
def mutated(draw, kind):
    """A body's bytes truncated, a byte replaced, or bytes inserted."""
    data = bytearray(draw(fields_body(kind)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["cut", "flip", "insert"]))
        if op == "cut":
            del data[at:]
        elif op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


@st.composite
def requests(draw):
    """(path, body bytes)."""
    kind = draw(st.sampled_from(["completion", "chat"]))
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    pick = draw(st.integers(0, 9))  # mostly schema-shaped bodies; the rest broken in one way or another
    body = draw(fields_body(kind) if pick < 6 else mutated(kind) if pick < 7 else st.binary(max_size=64) if pick < 8
                else nested().map(lambda r: r.encode()) if pick < 9 else anything.map(lambda v: dumps(v).encode()))
    return path, body


# -- the checks --------------------------------------------------------------------------------------
async def _send(client, path, body):
    async with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        return r.status_code, r.headers.get("content-type", ""), await r.aread()


def check_answer(status: int, ctype: str, raw: bytes, where) -> None:
    """2xx with a whole answer (a stream ending in [DONE], no error event) or 4xx with OpenAI's error."""
    assert status < 500, (where, status, raw[:300])
    if status >= 400:
        err = json.loads(raw)["error"]
        assert ctype == "application/json" and isinstance(err["message"], str) and isinstance(err["type"], str) \
            and set(err) == {"message", "type", "param", "code"}, (where, raw[:300])
        return
    if ctype.startswith("text/event-stream"):
        events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (where, raw[-300:])
        assert all("error" not in json.loads(e) for e in events[:-1]), (where, raw[-300:])
    else:
        assert json.loads(raw)["choices"], (where, raw[:300])


def known_answer(loop, client) -> list[int]:
    status, _, raw = loop.run_until_complete(_send(client, "/v1/completions", json.dumps(KNOWN).encode()))
    assert status == 200, raw[:300]
    return json.loads(raw)["choices"][0]["token_ids"]


def fuzz(fuzz_server, examples: int) -> Counter:
    """Runs the fuzzer; returns how the requests were answered ('json', 'stream' or the 4xx status)."""
    engine, loop, client, ref = fuzz_server
    assert known_answer(loop, client) == ref  # the server before the run: jaxgpt's generate, token for token
    log, answered = Records(), Counter()
    logging.getLogger().addHandler(log)

    examples = int(os.environ.get("JAXGPT_FUZZ_EXAMPLES", examples))

    @settings(max_examples=examples, derandomize=not _EXPLORE,
              deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(requests())
    def one(request):
        path, body = request
        since = len(log.records)
        answer = loop.run_until_complete(asyncio.wait_for(_send(client, path, body), 60))
        answered[answer[0] if answer[0] >= 300 else "stream" if answer[1].startswith("text/event") else "json"] += 1
        check_answer(*answer, where=(path, body[:200]))
        assert not log.bad(since), (path, body[:200], log.bad(since))
        assert pages_free(engine), (path, body[:200], engine.allocator.free, engine.allocator.total)

    try:
        one()
    finally:
        logging.getLogger().removeHandler(log)
    assert known_answer(loop, client) == ref  # after the run: the same tokens
    assert pages_free(engine) and not log.bad()
    assert sum(answered.values()) >= examples, answered
    return answered


def _check_coverage(answered: Counter) -> None:
    """Enough requests answered (streams too) that the fuzzer reaches the engine and the response
    writers, not only the refusals."""
    total = sum(answered.values())
    assert answered["json"] + answered["stream"] >= total // 5 and answered["stream"] >= total // 20, answered


def test_fuzz_requests_never_5xx(fuzz_server):
    """200 fuzzed requests (derandomized): no 5xx, no traceback, pages free, the known answer kept."""
    _check_coverage(fuzz(fuzz_server, 200))


@pytest.mark.slow  # 2,000 examples, ~25 s
def test_fuzz_requests_never_5xx_long(fuzz_server):
    _check_coverage(fuzz(fuzz_server, 2000))
