"""OpenAI-compatible HTTP server over the Engine (FastAPI; ``jaxgpt serve``).

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (when the tokenizer
has a chat template), GET /metrics (Prometheus text, ``metrics``). The handlers are ``routes``';
requests are parsed by ``protocol`` (every field honoured or refused by name), each choice
(n x prompts) is its own engine request (``server_run``), and ``responses`` writes the bodies. Each
choice's ``stopping.StopChecker`` decodes its text off the engine thread; at a stop string the
engine's request is aborted (the engine would otherwise decode on its thread).

Every failure is OpenAI's error body {"error": {"message", "type", "param", "code"}}: bad input a
4xx naming the field, a full queue 429 with Retry-After, a request that fails inside the engine a
500 for it alone, anything else a 500 from a catch-all (logged here with its traceback, which the
client never sees); a stream that fails after its headers ends with an SSE error event. A client
that disconnects has its requests aborted (pages freed). What a client controls is bounded by
``server_limits.ServeLimits`` (``create_app(..., limits=)``): body size and arrival time, JSON
nesting, counts and string lengths, and how long a response may go unread.
"""
from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxgpt.inference.engine_loop import EngineLoop
from jaxgpt.inference.errors import ApiError, error_body
from jaxgpt.inference.responses import ChoiceState
from jaxgpt.inference.routes import OpenAIRoutes, error_response, internal_error
from jaxgpt.inference.server_limits import RequestGuard, ServeLimits
from jaxgpt.inference.server_run import Run


class CatchAll:
    """ASGI middleware: an exception no handler took becomes a 500 with OpenAI's body (never
    Starlette's plain-text page), or, after the response has started, ends the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as e:  # noqa: BLE001 - the catch-all: a body for the client, the traceback for the log
            body = internal_error(e, f"{scope.get('method')} {scope.get('path')}")
            if not started:
                await JSONResponse(body, status_code=500)(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure a handler raises, in OpenAI's error body."""

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, f"{e.detail}: {request.method} {request.url.path}",
                              "invalid_request_error" if e.status_code < 500 else "server_error",
                              headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, f"{loc or 'the request'}: {first.get('msg', 'invalid')}", param=loc)


def create_app(engine, *, tokenizer=None, model_name: str = "jaxgpt", chat_template: str | None = None,
               max_waiting: int = 64, limits: ServeLimits | None = None) -> FastAPI:
    """The OpenAI app over ``engine`` (module docstring); ``limits`` bound what clients send
    (default ``ServeLimits()``, the defaults of ``jaxgpt serve``'s flags)."""
    limits = ServeLimits() if limits is None else limits
    loop_box: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if "loop" in loop_box:
            loop_box["loop"].close()

    def engine_loop() -> EngineLoop:
        if "loop" not in loop_box:
            loop_box["loop"] = EngineLoop(engine, max_waiting=max_waiting)
        return loop_box["loop"]

    app = FastAPI(title="jaxgpt serve", lifespan=lifespan)
    app.add_middleware(RequestGuard, limits=limits)
    app.add_middleware(CatchAll)  # outside the guard: a failure in it is a 500 with OpenAI's body too
    app.state.engine_loop = engine_loop
    _add_error_handlers(app)
    OpenAIRoutes(engine, engine_loop, tokenizer=tokenizer, model_name=model_name, chat_template=chat_template,
                 limits=limits).register(app)
    return app


__all__ = ["CatchAll", "ChoiceState", "Run", "create_app", "error_body", "error_response", "internal_error"]
