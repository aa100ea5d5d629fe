"""Serving operations around the OpenAI app: API key, per-request timeout, structured access logs.

``install(app, api_key=, request_timeout=, access_log=)`` adds three pure-ASGI middlewares (no
BaseHTTPMiddleware: it buffers nothing, so streams stay streams), outermost first:

* access log: one JSON line per HTTP request, written when its response ends (a stream: when the
  stream ends). Keys: ``time`` (ISO 8601 UTC, the request's arrival), ``method``, ``path``,
  ``status``, ``duration_ms``, ``request_id`` (the client's ``X-Request-Id`` or a new one; echoed
  in the response's ``X-Request-Id``), ``client`` ("host:port"), and ``prompt_tokens``,
  ``completion_tokens``, ``engine_request_id`` when the handler set them on ``request.state``
  (null otherwise).
* API key: paths under ``/v1`` need ``Authorization: Bearer KEY`` (as vLLM: ``/health`` and
  ``/metrics`` stay open for probes and scrapers); otherwise 401 with OpenAI's error body,
  ``code: invalid_api_key``.
* timeout: a request running longer than ``request_timeout`` seconds is cancelled: the handler
  sees CancelledError (its ``finally`` aborts the engine request, freeing its pages). Before the
  response started the client gets 504 with OpenAI's error body (``type: timeout_error``,
  ``code: request_timeout``): 504, not 408, because 408 says the *client* was slow to send its
  request (servers and proxies may drop the connection), while this is the server not finishing
  in time; the ``openai`` client retries 5xx with backoff, as it does 408. A stream already
  started gets a last SSE event with that error body and ``data: [DONE]``, and ends.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import uuid
from datetime import datetime, timezone

from jaxgpt.inference.errors import error_bytes


async def _send_json(send, status: int, body: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        msg = ("missing API key: send 'Authorization: Bearer KEY'" if not got
               else "incorrect API key in the Authorization header")
        await _send_json(send, 401, error_bytes(msg, "invalid_request_error", "invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])


class TimeoutMiddleware:
    def __init__(self, app, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "sse": False}

        async def tracked(msg):
            if msg["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(msg.get("headers", [])).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                state["ended"] = True
            await send(msg)

        try:
            await asyncio.wait_for(self.app(scope, receive, tracked), self.timeout)
        except asyncio.TimeoutError:
            msg = f"the request took longer than the server's request timeout ({self.timeout:g} s)"
            body = error_bytes(msg, "timeout_error", "request_timeout")
            if not state["started"]:
                await _send_json(send, 504, body)
            elif not state["ended"]:  # a stream: say why it ends, then end it as a finished one ends
                tail = b"data: " + body + b"\n\ndata: [DONE]\n\n" if state["sse"] else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})


class AccessLogMiddleware:
    def __init__(self, app, sink):
        self.app, self.sink = app, sink

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, arrived = time.perf_counter(), datetime.now(timezone.utc)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        rec = {"status": None}

        async def tracked(msg):
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
                msg = dict(msg, headers=[*msg.get("headers", []), (b"x-request-id", rid.encode("latin-1"))])
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except BaseException:
            rec["status"] = rec["status"] or 500  # ServerErrorMiddleware, outside us, answers 500
            raise
        finally:
            st = scope.get("state", {})
            client = scope.get("client")
            self.sink({"time": arrived.isoformat(timespec="milliseconds"), "method": scope["method"],
                       "path": scope["path"], "status": rec["status"],
                       "duration_ms": round(1000 * (time.perf_counter() - t0), 3), "request_id": rid,
                       "client": f"{client[0]}:{client[1]}" if client else None,
                       "prompt_tokens": st.get("prompt_tokens"), "completion_tokens": st.get("completion_tokens"),
                       "engine_request_id": st.get("engine_request_id")})


def json_lines(target):
    """A sink writing one JSON line per record: '-' stdout, a path (appended to), or a callable."""
    if callable(target):
        return target
    f = sys.stdout if target == "-" else open(target, "a", encoding="utf-8", buffering=1)  # open while the server runs
    lock = threading.Lock()

    def write(rec):
        with lock:
            f.write(json.dumps(rec) + "\n")
            f.flush()

    return write


def install(app, *, api_key: str | None = None, request_timeout: float | None = None, access_log=None):
    """Add the middlewares to a FastAPI/Starlette app before it starts (module docstring)."""
    if request_timeout is not None:
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        app.add_middleware(TimeoutMiddleware, timeout=float(request_timeout))
    if api_key is not None:
        if not api_key:
            raise ValueError("api_key is empty: give a key, or None for no key")
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if access_log is not None:  # added last: outermost, so 401s and timeouts are logged too
        app.add_middleware(AccessLogMiddleware, sink=json_lines(access_log))
    return app
