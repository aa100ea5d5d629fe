"""Bounds on what a client of ``jaxgpt serve`` controls (docs/serving.md, "Limits").

``ServeLimits`` holds them (``create_app(..., limits=)``; ``jaxgpt serve`` sets each from a flag).
Each is enforced before the work it bounds:

* ``RequestGuard``, an ASGI middleware of the app, reads every request body before a handler does:
  past ``max_request_bytes`` it answers 413 (from Content-Length before a byte is read, else as the
  body streams in, never holding more than the limit); a body that has not arrived within
  ``body_timeout`` seconds of the request's head (a client sending a byte a second) gets 408 and the
  connection is closed. A response ``send`` left unread for ``send_timeout`` seconds ends the
  response; the handler's engine requests are aborted and their pages freed.
* ``parse_json`` turns a body into JSON only after counting its nesting on the bytes, without
  recursion: ``json.loads`` recurses once per level, so a body nested 100,000 deep raised
  RecursionError. Deeper than ``max_json_depth`` is a 400, as are bodies that are not UTF-8 (RFC
  8259), NaN / Infinity (not JSON), numbers beyond float range and integers past Python's digit limit.
* ``ServeLimits.check_fields``: counts and string lengths (prompts, chat messages and their
  contents, ``user``, ``stop``, ``stop_token_ids``), a 400 naming the field, before any prompt is
  tokenized.
* ``uvicorn_protocol(limits)``: uvicorn's HTTP protocol with the bounds ASGI cannot see. A request
  head (request line and headers) over ``max_header_bytes`` gets 431; one not complete within
  ``header_timeout`` seconds of its first byte (of the connection, for the first request) and a
  connection whose client has left the server's writes unread for ``send_timeout`` seconds are
  closed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, fields

import numpy as np

from jaxgpt.inference.errors import ApiError, error_bytes
from jaxgpt.inference.server_ops import _send_json

log = logging.getLogger("jaxgpt.serve")
MAX_JSON_DEPTH = 256  # json.loads recurses once per level; Python's default recursion limit is 1,000


@dataclass(frozen=True)
class ServeLimits:
    """Every bound on what a client sends; the defaults are ``jaxgpt serve``'s (docs/serving.md lists
    each with its flag and vLLM's equivalent)."""

    max_request_bytes: int = 8 * 2 ** 20  # 413
    max_header_bytes: int = 64 * 2 ** 10  # 431 (uvicorn_protocol)
    max_json_depth: int = 32  # 400
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_messages: int = 1024  # messages in one chat request
    max_prompt_chars: int = 1_000_000  # one prompt string, or one chat message's content
    max_stop_chars: int = 256  # each stop string
    max_stop_token_ids: int = 256
    max_user_chars: int = 256
    header_timeout: float = 10.0  # seconds (uvicorn_protocol)
    body_timeout: float = 30.0  # seconds; 408
    send_timeout: float = 30.0  # seconds a client may leave a response unread

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be an integer >= 1, got {v!r}")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf):
                raise ValueError(f"{f.name} must be a number of seconds > 0, got {v!r}")
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(f"max_json_depth={self.max_json_depth} is over {MAX_JSON_DEPTH}: json.loads recurses "
                             "once per level and must stay under Python's recursion limit")

    def check_fields(self, body: dict, kind: str) -> None:
        """A 400 naming the field when a count or a string in a request body is over its limit. Values
        of the wrong type are left to ``protocol``, which refuses them by name."""
        def over(what: str, n: int, limit: int, param: str, flag: str):
            raise ApiError(400, f"{what} is {n}; this server takes at most {limit} (--{flag})", param=param,
                           code="limit_exceeded")

        user = body.get("user")
        if isinstance(user, str) and len(user) > self.max_user_chars:
            over("the length of user", len(user), self.max_user_chars, "user", "max-user-chars")
        stop = body.get("stop")
        for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
            if isinstance(s, str) and len(s) > self.max_stop_chars:
                over("the length of a stop string", len(s), self.max_stop_chars, "stop", "max-stop-chars")
        ids = body.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > self.max_stop_token_ids:
            over("the number of stop_token_ids", len(ids), self.max_stop_token_ids, "stop_token_ids",
                 "max-stop-token-ids")
        if kind == "completion":
            prompt = body.get("prompt")
            many = isinstance(prompt, list) and any(isinstance(p, list | str) for p in prompt)  # else one id list
            if many and len(prompt) > self.max_prompts:
                over("the number of prompts", len(prompt), self.max_prompts, "prompt", "max-prompts")
            for p in prompt if many else [prompt]:
                if isinstance(p, str) and len(p) > self.max_prompt_chars:
                    over("the length of a prompt", len(p), self.max_prompt_chars, "prompt", "max-prompt-chars")
            return
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        if len(messages) > self.max_messages:
            over("the number of messages", len(messages), self.max_messages, "messages", "max-messages")
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            n = len(content) if isinstance(content, str) else sum(
                len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ) if isinstance(content, list) else 0
            if n > self.max_prompt_chars:
                over(f"the length of messages[{i}].content", n, self.max_prompt_chars, "messages", "max-prompt-chars")


# -- JSON ----------------------------------------------------------------------------------------------
_STEP = np.zeros(256, np.int8)  # +1 opens an array or object, -1 closes one
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'[]{}"')


def json_depth(data: bytes, chunk: int = 1 << 20) -> int:
    """How deep arrays and objects nest in UTF-8 JSON text, counted on the bytes with no recursion
    and no parse (brackets inside strings do not count). Exact for valid JSON, and over the valid
    start of invalid JSON, which is all a parser reads before it fails."""
    # escaped backslashes go first, then escaped quotes: each '"' left opens or closes a string
    s = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURAL)
    deepest = depth = inside = 0
    for lo in range(0, len(s), chunk):  # chunks bound the temporaries of a large body
        a = np.frombuffer(s, np.uint8, count=min(chunk, len(s) - lo), offset=lo)
        in_string = (np.cumsum(a == _QUOTE, dtype=np.int64) + inside) & 1
        d = depth + np.cumsum(_STEP[a] * (in_string == 0), dtype=np.int64)
        deepest, depth, inside = max(deepest, int(d.max())), int(d[-1]), int(in_string[-1])
    return deepest


# a \uXXXX escape of a UTF-16 surrogate without its partner: JSON text allows it (RFC 8259, 8.2), text does not
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:40]} is beyond the float range")
    return x


def parse_json(data: bytes, limits: ServeLimits):
    """A request body's JSON value, or a 400 (module docstring)."""
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is skipped
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: it is not UTF-8 ({e})") from None
    lone = b"\\u" in data and _LONE_SURROGATE.search(data.replace(b"\\\\", b""))  # escaped backslashes dropped
    if lone:
        raise ApiError(400, f"the request body is not valid JSON text: {lone.group().decode()} is half of a UTF-16 "
                            "surrogate pair, which is no character (tokenizers cannot encode it)")
    depth = json_depth(data)
    if depth > limits.max_json_depth:
        raise ApiError(400, f"the request body nests arrays and objects {depth} deep; this server takes at most "
                            f"{limits.max_json_depth} (--max-json-depth)", code="json_too_deep")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, 1e999, an integer past Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


# -- ASGI: the body in, the response out ---------------------------------------------------------------
if sys.version_info >= (3, 11):
    async def _within(aw, seconds: float):
        async with asyncio.timeout(seconds):  # no task per call, unlike wait_for before 3.12
            return await aw
else:
    _within = asyncio.wait_for


def _head_too_large(limits: ServeLimits) -> str:
    return (f"the request head (request line and headers) is over this server's limit of {limits.max_header_bytes} "
            "bytes (--max-header-bytes)")


class ClientStalled(Exception):
    """A response send the client left unread for send_timeout seconds."""


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


class RequestGuard:
    """ASGI middleware (module docstring): the body read whole first, bounded in bytes and seconds,
    then replayed to the app; every send bounded in seconds."""

    def __init__(self, app, limits: ServeLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lim, loop = self.limits, asyncio.get_running_loop()
        deadline = loop.time() + lim.body_timeout
        too_large = (f"the request body is larger than this server's limit of {lim.max_request_bytes} bytes "
                     "(--max-request-bytes)")
        try:
            declared = int(dict(scope["headers"]).get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > lim.max_header_bytes:  # a head read whole
            return await self._refuse(send, 431, _head_too_large(lim), "request_header_too_large", receive, deadline)
        try:
            if declared > lim.max_request_bytes:
                raise _TooLarge
            body = await self._read(receive, deadline)
        except _TooLarge:
            return await self._refuse(send, 413, too_large, "request_too_large", receive, deadline)
        except asyncio.TimeoutError:
            msg = f"the request body did not arrive within {lim.body_timeout:g} s (--body-timeout)"
            return await self._refuse(send, 408, msg, "request_body_timeout")
        except _Gone:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def bounded_send(message):
            try:
                await _within(send(message), lim.send_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await self.app(scope, replay, bounded_send)
        except ClientStalled:
            client = scope.get("client") or ("?", 0)
            log.warning("%s:%s left its response to %s %s unread for %g s (--send-timeout): the response was cut "
                        "off and its requests aborted", *client, scope["method"], scope["path"], lim.send_timeout)

    async def _read(self, receive, deadline: float) -> bytes:
        loop, chunks, n = asyncio.get_running_loop(), [], 0
        while True:
            msg = await _within(receive(), max(0.0, deadline - loop.time()))
            if msg["type"] == "http.disconnect":
                raise _Gone
            part = msg.get("body", b"")
            n += len(part)
            if n > self.limits.max_request_bytes:
                raise _TooLarge
            chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str, receive=None, deadline: float = 0.0):
        """OpenAI's error body and 'connection: close'. With receive: the rest of the body is read and
        dropped until the deadline first, so a client still sending it reads this answer and not a
        reset connection (nginx's lingering close)."""
        body = error_bytes(message, "invalid_request_error", code)
        if receive is None:
            return await _send_json(send, status, body, [(b"connection", b"close")])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await _within(receive(), max(0.0, deadline - loop.time()))
                if msg["type"] != "http.request" or not msg.get("more_body", False):
                    break
        except asyncio.TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- uvicorn: the request head and the connection ------------------------------------------------------
def uvicorn_protocol(limits: ServeLimits):
    """uvicorn's HTTP protocol class (httptools, else h11) with the connection bounds of the module
    docstring: ``uvicorn.Config(app, http=uvicorn_protocol(limits))``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    too_large = error_bytes(_head_too_large(limits), "invalid_request_error", "request_header_too_large")

    class BoundedHTTPProtocol(AutoHTTPProtocol):
        _head_timer = _stall_timer = None
        _head_bytes = 0

        def _idle(self) -> bool:  # no request being answered: what arrives is a request head
            return self.cycle is None or self.cycle.response_complete

        def _stop(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_late)

        def data_received(self, data: bytes) -> None:
            before, idle = self.cycle, self._idle()
            if idle and self._head_timer is None:  # the first byte of a keep-alive connection's next request
                self._head_timer = self.loop.call_later(limits.header_timeout, self._head_late)
            super().data_received(data)
            if self.cycle is not before:  # the head is complete: the app has the request (RequestGuard times its body)
                self._stop("_head_timer")
                self._head_bytes = 0
            elif idle and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_header_bytes:
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                                         b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                         % (len(too_large), too_large))
                    self.transport.close()

        def _head_late(self) -> None:
            self._head_timer = None
            if self._idle() and not self.transport.is_closing():
                log.info("%s: closed a connection whose request head did not arrive within %g s (--header-timeout)",
                         self.client, limits.header_timeout)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._stop("_head_timer")  # the next request's head is timed from its first byte
            self._head_bytes = 0

        def pause_writing(self) -> None:  # the transport's buffer is full: the client is not reading
            super().pause_writing()
            self._stop("_stall_timer")
            self._stall_timer = self.loop.call_later(limits.send_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop("_stall_timer")

        def _stalled(self) -> None:
            self._stall_timer = None
            log.warning("%s left the server's writes unread for %g s (--send-timeout): connection closed",
                        self.client, limits.send_timeout)
            self.transport.abort()

        def connection_lost(self, exc) -> None:
            self._stop("_head_timer")
            self._stop("_stall_timer")
            super().connection_lost(exc)

    return BoundedHTTPProtocol


__all__ = ["ClientStalled", "MAX_JSON_DEPTH", "RequestGuard", "ServeLimits", "json_depth", "parse_json",
           "uvicorn_protocol"]
