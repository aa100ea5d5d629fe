"""``jaxgpt serve``'s bounds on what a client controls (``server_limits``): a 16 MB body gets 413, JSON
nested 100,000 deep 400, each count and string over its limit a 400 naming the field, NaN and
oversized numbers 400, none with a traceback in the log; a body that trickles in gets 408 and a
response left unread is cut off, its engine requests aborted and every page freed.

The fast tests drive the app in-process (httpx's ASGITransport, or the ASGI callable with a
receive/send of the test's making); the e2e tests put it on a real uvicorn with the connection-level
protocol of ``jaxgpt serve`` (127.0.0.1, an ephemeral port) and play the clients on raw sockets,
with timeouts of half a second. Every request loop is bounded in count and time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_module

require_module("fastapi", allow_module_level=True)
require_module("uvicorn", allow_module_level=True)
from test_serve_fuzz import NAME, TEMPLATE, Records, httpx, pages_free, tiny_engine  # noqa: E402

from jaxgpt.inference.server_limits import MAX_JSON_DEPTH, ServeLimits, json_depth  # noqa: E402

STEP_S = 0.08  # a slowed engine step: generation outlasts the timeouts below
LIMITS = ServeLimits(max_prompts=2, max_messages=3, max_prompt_chars=50, max_stop_chars=6, max_stop_token_ids=3,
                     max_user_chars=10, max_header_bytes=4096, header_timeout=0.5, body_timeout=0.5,
                     send_timeout=0.5)  # max_request_bytes and max_json_depth: the defaults


def _depth(value) -> int:
    """The nesting of a parsed JSON value, walked without recursion (the reference)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


tricky = st.text(st.sampled_from('[]{}"\\ab\u00e9\U0001f600'), max_size=8)  # brackets, quotes, escapes in strings
values = st.recursive(st.one_of(st.none(), st.integers(), tricky),
                      lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(tricky, c, max_size=3)),
                      max_leaves=12)


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(values, st.booleans(), st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_json_depth_equals_the_parsed_values(value, ascii_, chunk):
    """json_depth on the bytes equals the nesting of what json.loads makes of them, for strings full
    of brackets, quotes and backslashes, UTF-8 or ASCII-escaped, at chunk sizes that split them."""
    data = json.dumps(value, ensure_ascii=ascii_).encode()
    assert json_depth(data, chunk=chunk) == _depth(json.loads(data))


def test_json_depth_of_100000_levels_counts_them_all():
    data = b'{"a":' * 50_000 + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}" * 50_000
    assert json_depth(data) == 100_000
    assert json_depth(b'{"a": "[[[[\\"[[[", "b": [[]]}') == 3  # brackets in strings, an escaped quote


def test_limits_are_validated_by_name():
    for bad in ({"max_request_bytes": 0}, {"max_prompts": 2.5}, {"max_user_chars": True}, {"body_timeout": 0},
                {"send_timeout": float("inf")}, {"max_json_depth": MAX_JSON_DEPTH + 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeLimits(**bad)
    assert ServeLimits().max_request_bytes < 16 * 10 ** 6 and ServeLimits().max_json_depth < 100_000


# -- the app in-process --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited():
    """(app, engine, slow): the tiny engine behind create_app with LIMITS; slow['on'] sleeps STEP_S a step."""
    from jaxgpt.inference.server import create_app

    engine, tok = tiny_engine()[:2]
    slow, step = {"on": False}, engine.step
    engine.step = lambda: (time.sleep(STEP_S) if slow["on"] else None, step())[1]
    app = create_app(engine, tokenizer=tok, model_name=NAME, chat_template=TEMPLATE,
                     limits=LIMITS)
    yield app, engine, slow
    app.state.engine_loop().close()


def post_all(app, requests):
    """[(status, JSON body)] for [(path, body bytes or an async iterator of chunks)], in-process."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            out = []
            for path, body in requests:
                r = await asyncio.wait_for(c.post(path, content=body, headers={"content-type": "application/json"}),
                                           60)
                out.append((r.status_code, r.json()))
            return out
    return asyncio.run(go())


@pytest.fixture()
def log():
    records = Records()
    logging.getLogger().addHandler(records)
    yield records
    logging.getLogger().removeHandler(records)


def test_16mb_body_413_and_100000_deep_json_400_without_a_traceback(limited, log):
    """The issue's two failures: a 16 MB user string (with Content-Length, and streamed in 64 KiB chunks
    without one) and a body nested 100,000 deep, against the default limits."""
    app, engine, _ = limited

    async def chunks():
        for _ in range(16 * 16):
            yield b"a" * 65536

    big = b'{"prompt": "hi", "user": "' + b"a" * (16 * 10 ** 6) + b'"}'
    deep = b'{"prompt": "hi", "user": ' + b"[" * 99_999 + b"]" * 99_999 + b"}"  # 100,000 deep with the object
    answers = post_all(app, [("/v1/completions", big), ("/v1/chat/completions", chunks()),
                             ("/v1/completions", deep), ("/v1/chat/completions", b"[" * 100_000)])
    assert [(s, b["error"]["code"]) for s, b in answers] == [(413, "request_too_large")] * 2 + [
        (400, "json_too_deep")] * 2, answers
    assert "8388608 bytes" in answers[0][1]["error"]["message"] and "100000 deep" in answers[2][1]["error"]["message"]
    assert not log.bad() and pages_free(engine)
    ok = post_all(app, [("/v1/completions", b'{"prompt": "the cat", "max_tokens": 2}')])
    assert ok[0][0] == 200  # the server answers after them


@pytest.mark.parametrize("declared", [None, 16 * 10 ** 6])
def test_body_over_the_limit_is_refused_before_more_is_read(limited, declared):
    """Streamed without Content-Length, the 413 starts once the bytes read pass the limit (one chunk
    past it at most), not after the whole body; with a Content-Length over it, before a byte is read."""
    app, _, _ = limited
    read, first = [0], {}
    limit = ServeLimits().max_request_bytes

    async def receive():
        if read[0] >= 4 * limit:
            return {"type": "http.request", "body": b"", "more_body": False}
        read[0] += 65536
        return {"type": "http.request", "body": b" " * 65536, "more_body": True}

    async def send(message):
        first.setdefault(message["type"], (read[0], message))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": None}
    if declared:
        scope["headers"].append((b"content-length", str(declared).encode()))
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    n, start = first["http.response.start"]
    assert start["status"] == 413 and (n == 0 if declared else limit < n <= limit + 65536), n
    assert (b"connection", b"close") in start["headers"]


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {"prompt": "hi", "user": "u" * 11}, "user"),
    ("completion", {"prompt": "hi", "stop": ["ok", "s" * 7]}, "stop"),
    ("chat", {"stop": "s" * 7}, "stop"),
    ("completion", {"prompt": "hi", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ("completion", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("completion", {"prompt": [[1], [2], [3]]}, "prompt"),
    ("completion", {"prompt": "p" * 51}, "prompt"),
    ("completion", {"prompt": ["a", "p" * 51]}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 4}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "c" * 51}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "c" * 30}] * 2}]}, "messages"),
])
def test_each_count_and_string_over_its_limit_is_a_400_naming_it(limited, log, kind, body, param):
    app = limited[0]
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    base = {} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
    (status, out), = post_all(app, [(path, json.dumps({**base, **body}).encode())])
    assert status == 400 and out["error"]["param"] == param and out["error"]["code"] == "limit_exceeded", out
    assert "--max-" in out["error"]["message"] and not log.bad()


def test_at_the_limits_requests_are_answered(limited):
    app = limited[0]
    answers = post_all(app, [
        ("/v1/completions", json.dumps({"prompt": ["a", "p" * 50], "user": "u" * 10, "stop": ["s" * 6],
                                        "stop_token_ids": [1, 2, 3], "max_tokens": 2}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": ("the cat " * 7)[:50]},
                                                          {"role": "assistant", "content": "a"},
                                                          {"role": "user", "content": "b"}],
                                             "max_tokens": 2}).encode())])
    assert [s for s, _ in answers] == [200, 200], answers


@pytest.mark.parametrize("body, match", [
    (b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "hi", "temperature": 1e999}', "beyond the float range"),
    (b'{"prompt": "hi", "n": ' + b"1" * 5000 + b"}", "digits"),
    (b'{"prompt": "hi", "\\ud800": 1}', "surrogate"),
    (b'{"prompt": "\\udfff"}', "surrogate"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
    (b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1, "bogus": 1}', "Unrecognized request argument"),
    (b'{"prompt": "hi", "logit_bias": {"1": 5, "01": -5}}', "names token id 1 twice"),
])
def test_what_the_fuzzer_found_is_a_400(limited, log, body, match):
    """Each was a 500 (a lone surrogate: in a key, when the error body quoting it was encoded as
    UTF-8; in a prompt, in the tokenizer; NaN penalties, in SamplingParams; a 5,000-digit integer, in
    json.loads; two spellings of one logit_bias id, in SamplingParams) or a 200 sampled at temperature
    NaN; a byte-order mark is skipped."""
    (status, out), = post_all(limited[0], [("/v1/completions", body)])
    assert status == 400 and match in out["error"]["message"], out
    assert not log.bad()


def test_top_k_past_the_vocabulary_is_off(limited, log):
    """top_k = 2**31 failed the engine step (int32), and with it every request in the step: a 500,
    or an error event in a stream. k >= the vocabulary keeps every token, so it is top-k off."""
    body = {"prompt": "the cat", "max_tokens": 4, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    answers = post_all(limited[0], [("/v1/completions", json.dumps({**body, "top_k": k}).encode())
                                    for k in (2 ** 31, 10 ** 30, 0)])
    assert [s for s, _ in answers] == [200] * 3, answers
    ids = [out["choices"][0]["token_ids"] for _, out in answers]
    assert ids[0] == ids[1] == ids[2]  # the same seeded sample as top_k 0 (off)
    assert not log.bad()


def _asgi(app, path: str, receive, send):
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": None}
    return app(scope, receive, send)


def test_a_body_that_trickles_in_gets_408_and_close(limited, log):
    """One byte every 0.1 s: 408 at body_timeout (0.5 s), with 'connection: close'."""
    app, engine, _ = limited
    sent, t0 = [], time.perf_counter()

    async def receive():
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": b" ", "more_body": True}

    async def send(message):
        sent.append((time.perf_counter() - t0, message))

    asyncio.run(asyncio.wait_for(_asgi(app, "/v1/completions", receive, send), 10))
    at, start = sent[0]
    assert start["status"] == 408 and (b"connection", b"close") in start["headers"]
    assert LIMITS.body_timeout <= at < LIMITS.body_timeout + 1.0, at
    assert json.loads(sent[1][1]["body"])["error"]["code"] == "request_body_timeout"
    assert not engine.has_unfinished() and not log.bad()


def test_a_stream_left_unread_is_cut_and_its_pages_freed(limited, log):
    """A send that never returns after the third event (a client that stopped reading): at
    send_timeout the response ends, the engine request is aborted before its 40 tokens and every
    page is free; the cut is logged as a warning, with no traceback."""
    app, engine, slow = limited
    events, blocked, body = [], {}, json.dumps({"prompt": "the cat", "max_tokens": 40, "ignore_eos": True,
                                               "stream": True}).encode()
    done = asyncio.Event

    async def receive():
        if not events:
            events.append("request")
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(60)  # no disconnect: the client is there, it just does not read

    async def send(message):
        events.append(message["type"])
        if len(events) > 4:
            blocked.setdefault("at", time.perf_counter())
            await done().wait()  # never set

    slow["on"] = True
    tokens = engine.stats["generated_tokens"]
    try:
        t0 = time.perf_counter()
        asyncio.run(asyncio.wait_for(_asgi(app, "/v1/completions", receive, send), 20))
        ended = time.perf_counter()
        assert pages_free(engine, wait=1.0)
        freed = time.perf_counter()
    finally:
        slow["on"] = False
    assert LIMITS.send_timeout <= ended - blocked["at"] < LIMITS.send_timeout + 1.0, ended - blocked["at"]
    assert freed - t0 < 40 * STEP_S  # before the generation would have ended
    assert engine.stats["generated_tokens"] - tokens < 40
    assert any("unread for 0.5 s" in r.getMessage() for r in log.records) and not log.bad()


# -- a real uvicorn, raw sockets -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(limited):
    """The app on uvicorn with uvicorn_protocol(LIMITS), its listening socket's send buffer at 4 KiB
    (so a client that stops reading stalls the server's writes after little data): (port, log)."""
    import uvicorn

    from jaxgpt.inference.server_limits import uvicorn_protocol

    app = limited[0]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning",
                                           http=uvicorn_protocol(LIMITS)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.perf_counter() + 30
    while not server.started and time.perf_counter() < end:
        time.sleep(0.02)
    records = Records()
    logging.getLogger().addHandler(records)
    yield sock.getsockname()[1], records
    logging.getLogger().removeHandler(records)
    server.should_exit = True
    thread.join(timeout=10)


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    c = socket.socket()
    if rcvbuf:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    c.connect(("127.0.0.1", port))
    return c


def _closed_after(c: socket.socket, limit: float, trickle: bytes = b"", every: float = 0.05) -> tuple[float, bytes]:
    """(seconds until the server closed c, what it sent before), reading for at most limit s and
    sending trickle every `every` s meanwhile."""
    t0, got = time.perf_counter(), b""
    c.settimeout(every)
    while time.perf_counter() - t0 < limit:
        try:
            if trickle:
                c.send(trickle)
            part = c.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:
            break
        if not part:
            break
        got += part
    return time.perf_counter() - t0, got


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


@pytest.mark.e2e
def test_slowloris_body_gets_408_and_is_dropped(served, limited):
    """A head, then its body a byte every 0.1 s: 408 and the connection closed at body_timeout."""
    port, log = served
    since = len(log.records)
    with _connect(port) as c:
        c.sendall(_head("/v1/completions", 1000))
        took, got = _closed_after(c, 5, trickle=b" ", every=0.1)
    assert got.startswith(b"HTTP/1.1 408") and b"request_body_timeout" in got, got[:200]
    assert LIMITS.body_timeout - 0.1 <= took < LIMITS.body_timeout + 1.5, took
    assert not limited[1].has_unfinished() and not log.bad(since)


@pytest.mark.e2e
def test_slow_or_oversized_request_heads_are_dropped(served):
    """A connection that sends nothing, and a head sent a byte every 0.1 s, are closed at
    header_timeout; a head over max_header_bytes gets 431, whole or unfinished."""
    port, log = served
    since = len(log.records)
    with _connect(port) as idle:
        took, got = _closed_after(idle, 5)
        assert LIMITS.header_timeout - 0.1 <= took < LIMITS.header_timeout + 1.5 and got == b"", (took, got)
    with _connect(port) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        took, got = _closed_after(c, 5, trickle=b"x", every=0.1)
        assert took < LIMITS.header_timeout + 1.5 and got == b"", (took, got)
    for end in (b"\r\n\r\n", b""):  # a whole head (the app refuses it), one that never ends (the protocol does)
        with _connect(port) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 8000 + end)
            _, got = _closed_after(c, 5)
            assert got.startswith(b"HTTP/1.1 431") and b"request_header_too_large" in got, (end, got[:200])
    assert not log.bad(since)


@pytest.mark.e2e
def test_16mb_body_gets_413_that_the_client_reads(served):
    """urllib sends the whole 16 MB before it reads: the server reads and drops the rest after its
    413, so the client gets the answer instead of a reset connection."""
    import urllib.error
    import urllib.request

    port, log = served
    since = len(log.records)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"a" * (16 * 10 ** 6),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413 and json.loads(e.value.read())["error"]["code"] == "request_too_large"
    assert not log.bad(since)


@pytest.mark.e2e
def test_a_client_that_stops_reading_a_stream_is_dropped_and_its_pages_freed(served, limited):
    """A stream of four choices with 20 top log-probabilities a token (kilobytes an event) to a
    client with a 4 KiB receive buffer that never reads: once the buffers fill, the connection is
    aborted after send_timeout and the engine requests with it, long before their 40 tokens."""
    port, log = served
    _, engine, slow = limited
    since, tokens = len(log.records), engine.stats["generated_tokens"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 40, "logprobs": True,
                       "top_logprobs": 20, "ignore_eos": True, "stream": True}).encode()
    slow["on"] = True
    try:
        with _connect(port, rcvbuf=4096) as c:
            c.sendall(_head("/v1/chat/completions", len(body)) + body)
            t0 = time.perf_counter()
            while not engine.has_unfinished() and time.perf_counter() - t0 < 10:  # the requests reach the engine
                time.sleep(0.01)
            assert pages_free(engine, wait=40 * STEP_S)  # before the generation would have ended
            freed = time.perf_counter() - t0
            _, got = _closed_after(c, 5)
    finally:
        slow["on"] = False
    assert engine.stats["generated_tokens"] - tokens < 4 * 40
    assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got  # cut off mid-stream
    warned = [r for r in log.records[since:] if "unread for 0.5 s" in r.getMessage()]
    assert warned and not log.bad(since), (freed, [r.getMessage() for r in log.records[since:]])
