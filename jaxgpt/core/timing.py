"""The one step timer every benchmark uses (``jaxgpt bench``, scripts/benchmarks, the experiments'
timings), framework-free so torch's workers use it too without importing JAX."""
from __future__ import annotations

import time
from typing import Any, Callable


def step_times(step: Callable[[Any, Any], tuple[Any, Any]], state, batches, *, warm: int = 1,
               sync: Callable[[Any], Any] = lambda out: out, overlap: bool = False) -> tuple[Any, Any, list[float]]:
    """Run ``state, out = step(state, batch)`` over ``batches`` -> (state, last out, seconds).

    The first ``warm`` calls (compilation, allocator warm-up) are run, synchronised and not timed.
    ``sync(out)`` waits for a call's results (``jax.block_until_ready``: JAX dispatches
    asynchronously; the default suits a step that returns when done, as torch's do).
    ``overlap=False``: the wall time of each later call, synchronised one by one (medians, A B A B
    rounds). ``overlap=True``: the rest are dispatched back to back and synchronised once, as a
    training loop runs them (dispatch overlaps compute); seconds is [their mean]."""
    if len(batches) <= warm:
        raise ValueError(f"warm={warm} leaves none of the {len(batches)} batches to time")
    out = None
    for b in batches[:warm]:
        state, out = step(state, b)
        sync(out)
    timed, seconds = batches[warm:], []
    t = time.perf_counter()
    for b in timed:
        state, out = step(state, b)
        if not overlap:
            sync(out)
            seconds.append(time.perf_counter() - t)
            t = time.perf_counter()
    if overlap:
        sync((state, out))
        seconds = [(time.perf_counter() - t) / len(timed)]
    return state, out, seconds


__all__ = ["step_times"]
