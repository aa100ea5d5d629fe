"""OpenAI-compatible HTTP server over the Engine (FastAPI; ``jaxgpt serve``).

GET /health, GET /v1/models, POST /v1/completions (prompt as text or token ids, SSE streaming,
usage), POST /v1/chat/completions (when the tokenizer has a chat template), GET /metrics
(Prometheus text). vLLM's extensions: ``ignore_eos``, ``top_k``, ``stop_token_ids``,
``return_token_ids`` (``choices[i].token_ids`` and ``prompt_token_ids``, in stream chunks too).

Bad input is a 4xx with OpenAI's error body {"error": {"message", "type", "param", "code"}};
a full queue is 429 with Retry-After; a client that disconnects has its request aborted (pages
freed); an exception inside one request fails that request alone (500 for it, the server goes on).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxgpt.inference.engine_loop import EngineLoop, QueueFull
from jaxgpt.inference.protocol import ApiError, Detokenizer, parse_completion, render_chat, usage


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine, *, tokenizer=None, model_name: str = "jaxgpt", chat_template: str | None = None,
               max_waiting: int = 64) -> FastAPI:
    loop_box: dict = {}
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if "loop" in loop_box:
            loop_box["loop"].close()

    app = FastAPI(title="jaxgpt serve", lifespan=lifespan)

    def engine_loop() -> EngineLoop:
        if "loop" not in loop_box:
            loop_box["loop"] = EngineLoop(engine, max_waiting=max_waiting)
        return loop_box["loop"]

    app.state.engine_loop = engine_loop

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.get("/health")
    async def health():
        engine_loop()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "jaxgpt", "max_model_len": engine.config.max_len}]}

    @app.get("/metrics")
    async def metrics():
        el, a = engine_loop(), engine.allocator
        s = engine.stats
        lines = [
            ("jaxgpt_kv_pages_free", "gauge", "KV cache pages on the free list", a.free),
            ("jaxgpt_kv_pages_total", "gauge", "allocatable KV cache pages", a.total),
            ("jaxgpt_requests_running", "gauge", "requests in the running batch", len(engine.running)),
            ("jaxgpt_requests_waiting", "gauge", "requests waiting for admission", len(engine.waiting)),
            ("jaxgpt_generation_tokens_total", "counter", "output tokens generated", s["generated_tokens"]),
            ("jaxgpt_generation_tokens_per_second", "gauge", "output tokens/s over the last 10 s",
             el.tokens_per_second()),
            ("jaxgpt_preemptions_total", "counter", "requests preempted (pages freed, recomputed)", s["preemptions"]),
            ("jaxgpt_engine_steps_total", "counter", "engine steps", s["steps"]),
            ("jaxgpt_compiled_shapes", "gauge", "distinct (kind, rows, tokens, pages) shapes run", engine.compilations),
        ]
        if "spec_proposed" in s:
            rate = s["spec_accepted"] / max(1, s["spec_proposed"])
            lines.append(("jaxgpt_spec_acceptance_rate", "gauge", "accepted / proposed draft tokens", rate))
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return body

    async def _run(request: Request, prompt_ids, params, opts, kind: str):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        el = engine_loop()
        try:
            q = el.submit(rid, prompt_ids, params)
        except QueueFull as e:
            return error_response(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                                  code="queue_full", headers={"Retry-After": "1"})
        detok = Detokenizer(tokenizer, params.stop)
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text, ids, finish, logprobs, delta: bool):
            c = {"index": 0, "finish_reason": finish}
            if kind == "chat":
                c["delta" if delta else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
                c["logprobs"] = ({"tokens": [str(i) for i in ids], "token_logprobs": logprobs}
                                 if opts["logprobs"] else None)
            if opts["return_token_ids"]:
                c["token_ids"] = ids
            return c

        if opts["stream"]:
            async def events():
                n_out, done = 0, False
                try:
                    if opts["return_token_ids"]:
                        head = {"id": rid, "object": obj + (".chunk" if kind == "chat" else ""), "created": created,
                                "model": model_name, "prompt_token_ids": list(prompt_ids),
                                "choices": [choice("", [], None, [], True)]}
                        yield f"data: {json.dumps(head)}\n\n"
                    while not done:
                        out = await q.get()
                        if isinstance(out, BaseException):
                            err = {"error": {"message": str(out), "type": "internal_error", "param": None,
                                             "code": None}}
                            yield f"data: {json.dumps(err)}\n\n"
                            done = True
                            break
                        n_out += len(out.new_token_ids)
                        text = detok.add(out.new_token_ids, final=out.finished)
                        done = out.finished
                        finish = out.finish_reason if out.finish_reason != "error" else "error"
                        chunk = {"id": rid, "object": obj + (".chunk" if kind == "chat" else ""), "created": created,
                                 "model": model_name,
                                 "choices": [choice(text, out.new_token_ids, finish if done else None,
                                                    out.new_logprobs, True)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if opts["include_usage"]:
                        chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                                 "usage": usage(len(prompt_ids), n_out)}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:  # the client went away (or the generator was closed): free its pages
                        el.abort(rid)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        ids, logprobs, finish = [], [], None
        try:
            while True:
                try:
                    out = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        el.abort(rid)
                        return error_response(499, "the client closed the request", code="client_closed")
                    continue
                if isinstance(out, BaseException):
                    return error_response(500, f"this request failed: {out}", "internal_error")
                ids += out.new_token_ids
                logprobs += out.new_logprobs
                if out.finished:
                    if out.finish_reason == "error":
                        return error_response(500, f"this request failed: {out.error}", "internal_error")
                    finish = out.finish_reason
                    break
        except asyncio.CancelledError:
            el.abort(rid)
            raise
        text = detok.add(ids, final=True)
        body = {"id": rid, "object": obj, "created": created, "model": model_name,
                "choices": [choice(text, ids, finish, logprobs, False)], "usage": usage(len(prompt_ids), len(ids))}
        if opts["return_token_ids"]:
            body["prompt_token_ids"] = list(prompt_ids)
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        prompt_ids, params, opts = parse_completion(body, engine, tokenizer)
        return await _run(request, prompt_ids, params, opts, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        if chat_template is None or tokenizer is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           code="no_chat_template")
        body = dict(body, prompt=render_chat(chat_template, body.get("messages"), tokenizer))
        prompt_ids, params, opts = parse_completion(body, engine, tokenizer)
        return await _run(request, prompt_ids, params, opts, "chat")

    return app
