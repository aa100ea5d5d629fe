"""The training progress line: step, loss, tokens/s and ETA (``jaxgpt.train.loop.fit``)."""
from __future__ import annotations

import math
import sys
import time

from tqdm import std as tqdm_std
from tqdm.auto import tqdm

_NOTEBOOK = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)  # tqdm.auto picked the widget


class Progress:
    """Step, loss, tokens/s and ETA: a tqdm bar on a terminal (a widget in notebooks), plain lines
    at most every ``interval`` seconds otherwise (logs, CI), where redrawing a bar would leave
    carriage returns. The bar starts at the first update, so compilation does not count in the rate."""

    FORMAT = "{percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, total: int, stream=None, enabled: bool = True, interval: float = 10.0):
        self.total, self.stream, self.enabled, self.interval = total, stream or sys.stderr, enabled, interval
        self.interactive = enabled and (_NOTEBOOK or self.stream.isatty())
        self.bar, self.start, self.t0, self.last = None, None, None, -math.inf

    def update(self, step: int, loss: float, tok_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        postfix = f"loss {loss:.4f}, {tok_s / 1e3:.1f}k tok/s{extra}"
        if self.interactive:
            if self.bar is None:
                self.bar = tqdm(total=self.total, initial=step, file=self.stream, unit="step", dynamic_ncols=True,
                                smoothing=0.1)
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.t0, self.start = now, step
        if now - self.last >= self.interval or step >= self.total:
            self.stream.write(tqdm_std.tqdm.format_meter(step, self.total, now - self.t0, unit="step", postfix=postfix,
                                                         initial=self.start, bar_format=self.FORMAT) + "\n")
            self.stream.flush()
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


__all__ = ["Progress"]
