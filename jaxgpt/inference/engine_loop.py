"""The Engine on its own thread, fed by asyncio handlers (the server).

Only this thread touches the Engine: handlers post commands (add, abort) to a queue, and each
request's outputs come back through ``loop.call_soon_threadsafe`` into its asyncio.Queue. A
full waiting queue refuses new requests (``QueueFull``, the server's 429).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque

from jaxgpt.inference.engine import Engine
from jaxgpt.inference.requests import RequestOutput


class QueueFull(Exception):
    pass


class EngineLoop:
    def __init__(self, engine: Engine, *, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0  # added by handlers, not yet seen by the engine thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="jaxgpt-engine", daemon=True)
        self.thread.start()

    # -- handler side (event loop thread) -------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids, params) -> asyncio.Queue:
        with self._lock:
            if len(self.engine.waiting) + self._pending >= self.max_waiting:
                raise QueueFull(f"{len(self.engine.waiting) + self._pending} requests are waiting "
                                f"(max_waiting={self.max_waiting})")
            self._pending += 1
        q: asyncio.Queue = asyncio.Queue()
        self._sinks[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt_ids, params))
        return q

    def abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("noop",))
        self.thread.join(timeout=10)

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        return sum(n for _, n in recent) / window if recent else 0.0

    # -- engine thread ----------------------------------------------------------------------------------
    def _emit(self, out: RequestOutput | BaseException, request_id: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        loop, q = sink
        if isinstance(out, BaseException) or out.finished:
            self._sinks.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, out)

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, ids, params = cmd
            with self._lock:
                self._pending -= 1
            if rid not in self._sinks:  # cancelled before it reached the engine
                return
            try:
                self.engine.add_request(ids, params, request_id=rid)
            except Exception as e:  # noqa: BLE001  (validated by the server already; report, do not die)
                self._emit(e, rid)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                self._command(cmd)
                while True:
                    self._command(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001  a failed step fails the requests it held, not the server
                self.errors += 1
                for req in list(self.engine.running) + list(self.engine.waiting):
                    self.engine.abort(req.id)
                    self._emit(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"), req.id)
                continue
            self._recent.append((time.perf_counter(), len(outs)))
            while len(self._recent) > 4096:
                self._recent.popleft()
            for out in outs:
                if out.id not in self._sinks:  # its client is gone: free its pages now
                    if not out.finished:
                        self.engine.abort(out.id)
                    continue
                self._emit(out, out.id)
