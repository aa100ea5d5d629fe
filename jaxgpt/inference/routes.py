"""The OpenAI endpoints over one engine (``OpenAIRoutes``), registered on the app by ``server.create_app``:
GET /health, GET /v1/models[/{model}], GET /metrics, POST /v1/completions, POST /v1/chat/completions.
Bodies are parsed by ``protocol``, each choice runs as its own engine request (``server_run.Run``),
and ``responses`` writes the answers, whole or as server-sent events."""
from __future__ import annotations

import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from jaxgpt.inference.engine_loop import QueueFull
from jaxgpt.inference.errors import ApiError, error_body
from jaxgpt.inference.metrics import metrics_text
from jaxgpt.inference.protocol import Parsed, context, parse_chat, parse_completion
from jaxgpt.inference.responses import ChoiceState, Update, choice, token_text
from jaxgpt.inference.server_limits import ServeLimits, parse_json
from jaxgpt.inference.server_run import ClientGone, EventStream, RequestFailed, Run

log = logging.getLogger("jaxgpt.serve")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None):
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def internal_error(e: BaseException, where: str) -> dict:
    """Logs e with its traceback; the client gets its type only."""
    log.error("%s failed", where, exc_info=e)
    return error_body(f"internal server error ({type(e).__name__}); the server's log has the details",
                      "server_error", code="internal_error")


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class OpenAIRoutes:
    """The handlers; ``engine_loop()`` starts the engine's thread on first use (``EngineLoop``)."""

    def __init__(self, engine, engine_loop, *, tokenizer, model_name: str, chat_template: str | None,
                 limits: ServeLimits):
        self.engine, self.engine_loop, self.tokenizer = engine, engine_loop, tokenizer
        self.model_name, self.chat_template, self.limits = model_name, chat_template, limits
        self.started = time.time()

    def register(self, app) -> None:
        for path, handler, method in (("/health", self.health, "GET"), ("/v1/models", self.models, "GET"),
                                      ("/v1/models/{model}", self.model, "GET"), ("/metrics", self.metrics, "GET"),
                                      ("/v1/completions", self.completions, "POST"),
                                      ("/v1/chat/completions", self.chat, "POST")):
            app.add_api_route(path, handler, methods=[method])

    # -- GET ----------------------------------------------------------------------------------------
    async def health(self):
        self.engine_loop()
        return {"status": "ok"}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "jaxgpt",
                "max_model_len": context(self.engine)}

    def _check_model(self, model) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str):
        self._check_model(model)
        return self._model_card()

    async def metrics(self):
        text = metrics_text(self.engine, self.engine_loop().tokens_per_second())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # -- POST ---------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        body = await self._body(request, "completion")
        return await self._generate(request, parse_completion(body, self.engine, self.tokenizer))

    async def chat(self, request: Request):
        body = await self._body(request, "chat")
        if self.chat_template is None or self.tokenizer is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           code="no_chat_template")
        return await self._generate(request, parse_chat(body, self.engine, self.tokenizer, self.chat_template))

    async def _body(self, request: Request, kind: str) -> dict:
        body = parse_json(await request.body(), self.limits)
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        self._check_model(body.get("model"))
        self.limits.check_fields(body, kind)
        return body

    def _echo(self, p: Parsed, st: ChoiceState) -> str:
        return self.tokenizer.decode(st.prompt) if p.echo and self.tokenizer is not None else ""

    async def _generate(self, request: Request, p: Parsed):
        request.state.user = p.user  # for an access log
        run = Run(self.engine_loop(), p, self.tokenizer)
        run.state, request.state.engine_request_id = request.state, run.id
        try:
            run.submit()
        except QueueFull as e:
            return error_response(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                                  code="queue_full", headers={"Retry-After": "1"})
        head = {"id": run.id, "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if p.stream:
            return EventStream(self._events(run, p, head), media_type="text/event-stream",
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
            echo = self._echo(p, st)
            u = Update(st.ids, st.logprobs, st.tops, echo + st.text, st.finish)
            choices.append(choice(p, self.tokenizer, st, u, delta=False, first=True, offset=len(echo)))
        body = dict(head, object="chat.completion" if p.kind == "chat" else "text_completion", choices=choices,
                    usage=run.usage())
        if p.return_token_ids and len(p.prompts) == 1:
            body["prompt_token_ids"] = list(p.prompts[0])
        return JSONResponse(body)

    async def _events(self, run: Run, p: Parsed, head: dict):
        tokenizer, offsets = self.tokenizer, [0] * len(run.states)
        try:
            for st in run.states:  # chat's role delta; completions' echo / prompt_token_ids
                if p.kind == "chat" or p.echo or p.return_token_ids:
                    echo = self._echo(p, st)
                    offsets[st.index] = len(echo)
                    yield _data(dict(head, choices=[choice(p, tokenizer, st, Update([], [], [], echo), delta=True,
                                                           first=True)]))
            async for st, u in run.updates():
                c = choice(p, tokenizer, st, u, delta=True, first=False, offset=offsets[st.index])
                if p.logprobs is not None:
                    offsets[st.index] += sum(len(token_text(tokenizer, i)) for i in u.ids)
                yield _data(dict(head, choices=[c]))
            if p.include_usage:
                yield _data(dict(head, choices=[], usage=run.usage()))
            yield "data: [DONE]\n\n"
        except RequestFailed as e:
            yield _data(error_body(f"this request failed: {e}", "server_error", code="request_failed"))
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
            yield _data(internal_error(e, "a stream"))
        finally:
            run.close()


__all__ = ["OpenAIRoutes", "error_response", "internal_error"]
