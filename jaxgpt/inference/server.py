"""OpenAI-compatible HTTP server over the Engine (FastAPI; ``jaxgpt serve``).

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (when the tokenizer
has a chat template), GET /metrics (Prometheus text). Requests are parsed by ``protocol`` (every
field honoured or refused by name), each choice (n x prompts) is its own engine request, and
``responses`` writes the bodies. Stop strings are decided here, by each choice's detokenizer: the
engine's request is aborted when one appears (the engine would otherwise decode on its thread).

Every failure is OpenAI's error body {"error": {"message", "type", "param", "code"}}: bad input a
4xx naming the field, a full queue 429 with Retry-After, a request that fails inside the engine a
500 for it alone, anything else a 500 from a catch-all (logged here with its traceback, which the
client never sees); a stream that fails after its headers ends with an SSE error event. A client
that disconnects has its requests aborted (pages freed). What a client controls is bounded by
``server_limits.ServeLimits`` (``create_app(..., limits=)``): body size and arrival time, JSON
nesting, counts and string lengths, and how long a response may go unread.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxgpt.inference.engine_loop import EngineLoop, QueueFull
from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.protocol import ApiError, Parsed, context, parse_chat, parse_completion, usage
from jaxgpt.inference.responses import ChoiceState, Update, choice, token_text
from jaxgpt.inference.server_limits import RequestGuard, ServeLimits, parse_json

log = logging.getLogger("jaxgpt.serve")


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None):
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def internal_error(e: BaseException, where: str) -> dict:
    """Logs e with its traceback; the client gets its type only."""
    log.error("%s failed", where, exc_info=e)
    return error_body(f"internal server error ({type(e).__name__}); the server's log has the details",
                      "server_error", code="internal_error")


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


class EventStream(StreamingResponse):
    """A stream that closes its events generator however the response ends (a send cut off by
    --send-timeout, a cancellation), so the generator's cleanup aborts its engine requests now
    rather than when the generator is collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


class RequestFailed(Exception):
    pass


class ClientGone(Exception):
    pass


class Run:
    """One request's choices in the engine: submit, merged updates, and cleanup (abort what is left)."""

    def __init__(self, el: EngineLoop, p: Parsed, tokenizer):
        self.el, self.p = el, p
        base = f"{'chatcmpl' if p.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.id = base
        self.states = [ChoiceState(c, f"{base}-{c}", p.prompts[c // p.n], Detokenizer(tokenizer, p.stop))
                       for c in range(len(p.params))]
        self.merged: asyncio.Queue = asyncio.Queue()  # (choice, output); one choice: its own queue of outputs
        self.state = None  # the HTTP request's state, for the access log
        self.pumps: list[asyncio.Task] = []

    def submit(self) -> None:
        """Every choice to the engine, or none (QueueFull after aborting those already in)."""
        if len(self.states) == 1:  # one choice reads its own queue: no task hop per token
            self.merged = self.el.submit(self.states[0].rid, self.states[0].prompt, self.p.params[0])
            return
        try:
            for st, sp in zip(self.states, self.p.params):
                q = self.el.submit(st.rid, st.prompt, sp)
                self.pumps.append(asyncio.create_task(self._pump(st.index, q)))
        except QueueFull:
            self.close()
            raise

    async def _pump(self, c: int, q: asyncio.Queue) -> None:
        while True:
            out = await q.get()
            self.merged.put_nowait((c, out))
            if isinstance(out, BaseException) or out.finished:
                return

    async def updates(self, request: Request | None = None):
        """(choice state, Update) as outputs arrive; with a request, polls it for a disconnect."""
        live = len(self.states)
        while live:
            if request is None:
                item = await self.merged.get()
            else:
                try:
                    item = await asyncio.wait_for(self.merged.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone() from None
                    continue
            c, out = item if self.pumps else (0, item)
            st = self.states[c]
            if st.finish is not None:  # after a stop string: outputs already on their way
                continue
            if isinstance(out, BaseException):
                raise RequestFailed(str(out))
            if out.finished and out.finish_reason == "error":
                raise RequestFailed(out.error)
            u = st.add(out)
            if u.finish is not None:
                live -= 1
                if not out.finished:  # a stop string: the engine would go on decoding
                    self.el.abort(st.rid)
            yield st, u

    def close(self) -> None:
        for st in self.states:
            if st.finish is None:
                self.el.abort(st.rid)
        for t in self.pumps:
            t.cancel()
        if self.state is not None:  # what the access log (server_ops) records for this request
            u = self.usage()
            self.state.prompt_tokens, self.state.completion_tokens = u["prompt_tokens"], u["completion_tokens"]

    def usage(self) -> dict:
        return usage(sum(len(x) for x in self.p.prompts), sum(len(st.ids) for st in self.states))


def create_app(engine, *, tokenizer=None, model_name: str = "jaxgpt", chat_template: str | None = None,
               max_waiting: int = 64, limits: ServeLimits | None = None) -> FastAPI:
    """The OpenAI app over ``engine`` (module docstring); ``limits`` bound what clients send
    (default ``ServeLimits()``, the defaults of ``jaxgpt serve``'s flags)."""
    limits = ServeLimits() if limits is None else limits
    loop_box: dict = {}
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if "loop" in loop_box:
            loop_box["loop"].close()

    app = FastAPI(title="jaxgpt serve", lifespan=lifespan)
    app.add_middleware(RequestGuard, limits=limits)
    app.add_middleware(CatchAll)  # outside the guard: a failure in it is a 500 with OpenAI's body too

    def engine_loop() -> EngineLoop:
        if "loop" not in loop_box:
            loop_box["loop"] = EngineLoop(engine, max_waiting=max_waiting)
        return loop_box["loop"]

    app.state.engine_loop = engine_loop

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

    @app.get("/health")
    async def health():
        engine_loop()
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(started), "owned_by": "jaxgpt",
                "max_model_len": context(engine)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str):
        if model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        el, a = engine_loop(), engine.allocator
        s = engine.stats
        lines = [
            ("jaxgpt_kv_pages_free", "gauge", "KV cache pages on the free list", a.free),
            ("jaxgpt_kv_pages_total", "gauge", "allocatable KV cache pages", a.total),
            ("jaxgpt_requests_running", "gauge", "requests in the running batch", len(engine.running)),
            ("jaxgpt_requests_waiting", "gauge", "requests waiting for admission", len(engine.waiting)),
            ("jaxgpt_prompt_tokens_total", "counter", "prompt tokens received", s["prompt_tokens"]),
            ("jaxgpt_generation_tokens_total", "counter", "output tokens generated", s["generated_tokens"]),
            ("jaxgpt_generation_tokens_per_second", "gauge", "output tokens/s over the last 10 s",
             el.tokens_per_second()),
            ("jaxgpt_preemptions_total", "counter", "requests preempted (pages freed, recomputed)", s["preemptions"]),
            ("jaxgpt_engine_steps_total", "counter", "engine steps", s["steps"]),
            ("jaxgpt_compiled_shapes", "gauge", "distinct (kind, rows, tokens, pages) shapes run", engine.compilations),
        ]
        if "spec_proposed" in s:
            rate = s["spec_accepted"] / max(1, s["spec_proposed"])
            lines += [("jaxgpt_spec_acceptance_rate", "gauge", "accepted / proposed draft tokens", rate),
                      ("jaxgpt_spec_rounds_total", "counter", "steps that ran a speculative round", s["spec_rounds"]),
                      ("jaxgpt_spec_off_steps_total", "counter", "steps whose decoding rows could speculate but "
                       "took plain decode steps (the batch's rule said it loses)", s["spec_off_steps"])]
        if engine.spec_policy is not None:  # spec_max_batch='auto': what its rule measured and decided
            est = engine.spec_policy.estimates()
            per = est["buckets"].items()
            lines += [("jaxgpt_spec_alpha", "gauge", "per-token acceptance estimate of the auto rule", est["alpha"]),
                      ("jaxgpt_spec_expected_tokens", "gauge", "tokens a row emits per round at that alpha",
                       est["expected_tokens"])]
            for name, key, help_ in (("jaxgpt_spec_round_seconds", "t_spec", "median seconds of a speculative call"),
                                     ("jaxgpt_decode_step_seconds", "t_plain", "median seconds of a plain decode call")):
                lines.append((name, "gauge", help_ + " by rows bucket", {f'rows="{b}"': e[key] for b, e in per
                                                                         if e[key] is not None}))
            lines.append(("jaxgpt_spec_on", "gauge", "1 where the auto rule's estimates say speculation wins, by rows "
                          "bucket (it still explores the losing mode now and then)",
                          {f'rows="{b}"': int(e["wins"]) for b, e in per if e["wins"] is not None}))
        if "prefix_queries" in s:
            lines += [("jaxgpt_prefix_cache_hit_rate", "gauge", "prompt tokens found in the prefix cache / looked up",
                       s["prefix_hits"] / max(1, s["prefix_queries"])),
                      ("jaxgpt_prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache",
                       s["prefix_hits"])]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n" + ("".join(f"{n}{{{lab}}} {x}\n" for lab, x in v.items())
                                                               if isinstance(v, dict) else f"{n} {v}\n")
                       for n, t, h, v in lines)  # a dict: one sample a label set
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _body(request: Request, kind: str) -> dict:
        body = parse_json(await request.body(), limits)
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        limits.check_fields(body, kind)
        return body

    def _echo(p: Parsed, st: ChoiceState) -> str:
        return tokenizer.decode(st.prompt) if p.echo and tokenizer is not None else ""

    async def _generate(request: Request, p: Parsed):
        request.state.user = p.user  # for an access log
        run = Run(engine_loop(), p, tokenizer)
        run.state, request.state.engine_request_id = request.state, run.id
        try:
            run.submit()
        except QueueFull as e:
            return error_response(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                                  code="queue_full", headers={"Retry-After": "1"})
        created = int(time.time())
        head = {"id": run.id, "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
                "created": created, "model": model_name}
        if p.stream:
            return EventStream(_events(run, p, head), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        try:
            async for _ in run.updates(request):
                pass
        except ClientGone:
            return error_response(499, "the client closed the request", code="client_closed")
        except RequestFailed as e:
            return error_response(500, f"this request failed: {e}", "server_error", code="request_failed")
        finally:
            run.close()
        choices = []
        for st in run.states:
            echo = _echo(p, st)
            u = Update(st.ids, st.logprobs, st.tops, echo + st.text, st.finish)
            choices.append(choice(p, tokenizer, st, u, delta=False, first=True, offset=len(echo)))
        body = dict(head, object="chat.completion" if p.kind == "chat" else "text_completion", choices=choices,
                    usage=run.usage())
        if p.return_token_ids and len(p.prompts) == 1:
            body["prompt_token_ids"] = list(p.prompts[0])
        return JSONResponse(body)

    async def _events(run: Run, p: Parsed, head: dict):
        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        offsets = [0] * len(run.states)
        try:
            for st in run.states:  # chat's role delta; completions' echo / prompt_token_ids
                if p.kind == "chat" or p.echo or p.return_token_ids:
                    echo = _echo(p, st)
                    offsets[st.index] = len(echo)
                    yield data(dict(head, choices=[choice(p, tokenizer, st, Update([], [], [], echo), delta=True,
                                                          first=True)]))
            async for st, u in run.updates():
                c = choice(p, tokenizer, st, u, delta=True, first=False, offset=offsets[st.index])
                if p.logprobs is not None:
                    offsets[st.index] += sum(len(token_text(tokenizer, i)) for i in u.ids)
                yield data(dict(head, choices=[c]))
            if p.include_usage:
                yield data(dict(head, choices=[], usage=run.usage()))
            yield "data: [DONE]\n\n"
        except RequestFailed as e:
            yield data(error_body(f"this request failed: {e}", "server_error", code="request_failed"))
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
            yield data(internal_error(e, "a stream"))
        finally:
            run.close()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, "completion")
        return await _generate(request, parse_completion(body, engine, tokenizer))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, "chat")
        if chat_template is None or tokenizer is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           code="no_chat_template")
        return await _generate(request, parse_chat(body, engine, tokenizer, chat_template))

    return app
