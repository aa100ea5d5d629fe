"""How many CPU devices JAX makes on this host, decided before its backend starts (framework-free).

XLA:CPU runs one program per device, and its intra-op threading leaves cores idle on the small
matmuls and fusions of a CPU-sized model. Splitting the batch over one device per core (data
parallel, ``TrainConfig.mesh='auto'``) is faster on a multi-core CPU (docs/performance.md).

Importing jaxgpt changes nothing: the ``jaxgpt`` command and ``jaxgpt.train.fit`` call
``use_host_devices()`` before they start JAX, and a program of your own may call it first thing
(``jaxgpt.use_host_devices()``). 'auto' asks for one CPU device per core, up to ``AUTO_MAX``, unless
the user has chosen: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, or
``JAXGPT_HOST_DEVICES=N`` (1 turns it off). Accelerator backends are untouched: the flag only
shapes the CPU platform.
"""
from __future__ import annotations

import os
import re
import sys

ENV = "JAXGPT_HOST_DEVICES"
FLAG = "--xla_force_host_platform_device_count"
# No larger count was benchmarked (docs/performance.md); each device holds a replica of params and optimizer state
AUTO_MAX = 2


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # the only way to ask "has a backend started?" without starting one

    return xla_bridge.backends_are_initialized()


def requested() -> int:
    """The host device count ``JAXGPT_HOST_DEVICES`` asks for ('auto' or unset: one per core, up to AUTO_MAX)."""
    value = os.environ.get(ENV, "auto").strip()
    if value == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, AUTO_MAX))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: expected 'auto' or a device count >= 1")
    return int(value)


def use_host_devices(n: int | str = "auto") -> int | None:
    """Give JAX's CPU platform ``n`` devices (XLA_FLAGS), before JAX starts its backend.

    n='auto': ``requested()`` devices, unless XLA_FLAGS already names a count or JAX has started
    (then nothing changes and None is returned: the user's or the running backend's choice stands).
    n an int: exactly that many (also to simulate a mesh on one host); an error if JAX has already
    started with fewer. Returns the count set (or already there, for an int)."""
    if n == "auto":
        if FLAG in os.environ.get("XLA_FLAGS", "") or _backend_started():
            return None
        n = requested()
        if n == 1:
            return 1
    elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"host device count must be 'auto' or an int >= 1, got {n!r}")
    elif _backend_started():
        import jax

        have = jax.device_count()
        if have >= n:
            return n
        raise ValueError(f"JAX has already started with {have} device(s), so {n} host devices cannot be added; "
                         f"set XLA_FLAGS={FLAG}={n} in the environment, or call use_host_devices before anything "
                         "runs a JAX computation")
    flags = re.sub(rf"{FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={n}".strip()
    return n


__all__ = ["AUTO_MAX", "ENV", "FLAG", "requested", "use_host_devices"]
