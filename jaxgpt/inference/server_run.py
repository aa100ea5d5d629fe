"""One HTTP request's choices in the engine (``Run``): submitted together, their outputs merged into one
queue as they arrive, each choice's text and finish followed by its ``responses.ChoiceState``, and what
is left aborted when the response ends however it ends (``EventStream`` closes a stream's generator)."""
from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.engine_loop import EngineLoop, QueueFull
from jaxgpt.inference.protocol import Parsed, usage
from jaxgpt.inference.responses import ChoiceState
from jaxgpt.inference.stopping import StopChecker


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
        eng = el.engine  # a choice stops where its engine request does, or earlier at a stop string
        self.states = [ChoiceState(c, f"{base}-{c}", p.prompts[c // p.n],
                                   StopChecker(sp, eos_ids=eng.eos_ids, max_model_len=eng.max_model_len,
                                               detok=Detokenizer(tokenizer, p.stop)))
                       for c, sp in enumerate(p.params)]
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


__all__ = ["ClientGone", "EventStream", "RequestFailed", "Run"]
