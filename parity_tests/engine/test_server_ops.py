"""Serving operations (jaxgpt/inference/server_ops.py) on ``server.create_app``'s app in a real
uvicorn (a thread), driven by the official ``openai`` client and raw HTTP: the API key (401 with
OpenAI's error body; /health open), the request timeout (504 with OpenAI's error body before the
response starts, a last error event in a started stream; either way the engine request is
aborted and every page is free again), and the access log's JSON records.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jax
import pytest

from conftest import require_module

openai = require_module("openai", allow_module_level=True)
require_module("fastapi", allow_module_level=True)
require_module("uvicorn", allow_module_level=True)
from fastapi import Request  # noqa: E402 - after the check that fastapi is installed
from test_serve import start  # noqa: E402

KEY, TIMEOUT = "sk-test-123", 1.0


@pytest.fixture(scope="module")
def served():
    from jaxgpt.config import ModelConfig
    from jaxgpt.inference.engine import Engine
    from jaxgpt.inference.server import create_app
    from jaxgpt.inference.server_ops import install
    from jaxgpt.models import init_params

    config = ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2, max_len=64, pos="rope")
    engine = Engine(config, init_params(config, jax.random.PRNGKey(0)), max_seqs=4, page_size=16,
                    max_tokens_per_step=32)
    engine.precompile()  # no request waits on a compilation: the timeout measures decoding alone
    slow = {"on": False}
    step = engine.step
    engine.step = lambda: (time.sleep(0.2) if slow["on"] else None, step())[1]
    logs: list[dict] = []
    app = create_app(engine, model_name="tiny")

    @app.get("/v1/tokens-demo")  # a handler that reports its tokens to the access log
    async def demo(request: Request):
        request.state.prompt_tokens, request.state.completion_tokens = 3, 4
        return {"ok": True}

    install(app, api_key=KEY, request_timeout=TIMEOUT, access_log=logs.append)
    server, thread, url = start(app)
    yield url, engine, slow, logs
    server.should_exit = True
    thread.join(timeout=10)


def _raw(url, path, key=None, body=None):
    headers = {"Content-Type": "application/json", "X-Request-Id": "abc-1"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _all_pages_free(engine, wait=2.0):
    """Within 2 s: the request, left alone, would decode for 8 s more (50 tokens, 0.2 s a step)."""
    t = time.time() + wait
    while time.time() < t:
        if not engine.has_unfinished() and engine.allocator.free == engine.allocator.total:
            return True
        time.sleep(0.05)
    return False


def test_api_key_is_required_under_v1_and_health_stays_open(served):
    url, *_ = served
    for key, what in ((None, "missing API key"), ("wrong", "incorrect API key")):
        status, body, headers = _raw(url, "/v1/models", key)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert body["error"]["code"] == "invalid_api_key" and what in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert _raw(url, "/health")[0] == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert len(out.choices[0].text) >= 0 and out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_timeout_before_the_response_is_504_and_frees_the_pages(served):
    url, engine, slow, _ = served
    slow["on"] = True
    try:
        t0 = time.time()
        status, body, _ = _raw(url, "/v1/completions", KEY, {"prompt": [1, 2, 3], "max_tokens": 50})
        assert time.time() - t0 < TIMEOUT + 2
        assert _all_pages_free(engine)  # still slow: freed by the abort, not by finishing
    finally:
        slow["on"] = False
    assert status == 504, body
    assert body["error"]["type"] == "timeout_error" and body["error"]["code"] == "request_timeout"


def test_timeout_in_a_stream_ends_it_with_an_error_event_and_frees_the_pages(served):
    url, engine, slow, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    slow["on"] = True
    chunks = 0
    try:
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=50, temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="request timeout"):
            for _ in stream:
                chunks += 1
        assert _all_pages_free(engine)  # still slow: freed by the abort, not by finishing
    finally:
        slow["on"] = False
    assert 0 < chunks < 10  # it had started


def test_access_log_has_one_json_record_per_request(served):
    url, _, _, logs = served
    logs.clear()
    status, _, headers = _raw(url, "/v1/tokens-demo", KEY)
    assert status == 200 and headers["x-request-id"] == "abc-1"
    _raw(url, "/v1/models")  # a 401 is logged too
    _raw(url, "/health")
    t = time.time() + 5
    while len(logs) < 3 and time.time() < t:  # written when the handler returns, just after the response
        time.sleep(0.01)
    assert [(r["path"], r["status"]) for r in logs] == [("/v1/tokens-demo", 200), ("/v1/models", 401),
                                                        ("/health", 200)]
    r = logs[0]
    assert set(r) == {"time", "method", "path", "status", "duration_ms", "request_id", "client", "prompt_tokens",
                      "completion_tokens", "engine_request_id"}
    assert r["method"] == "GET" and r["request_id"] == "abc-1" and r["duration_ms"] > 0
    assert (r["prompt_tokens"], r["completion_tokens"]) == (3, 4) and logs[2]["prompt_tokens"] is None
    json.dumps(logs)  # every record is JSON


def test_install_rejects_bad_settings():
    from fastapi import FastAPI

    from jaxgpt.inference.server_ops import install

    with pytest.raises(ValueError, match="request_timeout must be > 0 seconds, got 0"):
        install(FastAPI(), request_timeout=0)
    with pytest.raises(ValueError, match="api_key is empty"):
        install(FastAPI(), api_key="")
