"""Host-side prefetch: a thread builds the next batches while the device runs the current step.

Batches stay pure functions of the step (the thread calls the same ``fn(step)`` in step order),
so prefetching changes when a batch is built, never what it holds. An exception raised while
building batch s (a bad id, a KeyboardInterrupt test hook) is re-raised by ``get(s)``, in order.
NumPy releases the GIL in copies and memmap reads, so the thread overlaps the training step.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable


class Prefetch:
    """``get(step)`` returns ``fn(step)``, built up to ``depth`` steps ahead by a daemon thread.
    Steps must be asked for in the order of ``steps``. ``close()`` stops the thread."""

    def __init__(self, fn: Callable[[int], object], steps: Iterable[int], depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth!r}")
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, iter(steps)), daemon=True,
                                        name="jaxgpt-prefetch")
        self._thread.start()

    def _run(self, fn, steps) -> None:
        for s in steps:
            try:
                item = (s, fn(s), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, at its step
                item = (s, None, e)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, step: int):
        s, value, err = self._q.get()
        if s != step:
            raise RuntimeError(f"prefetch: asked for step {step}, the next built is {s} (steps out of order)")
        if err is not None:
            raise err
        return value

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a put waiting on a full queue
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Prefetch"]
