"""How many CPU devices JAX makes on this host, decided before its backend starts (framework-free).

XLA:CPU runs one program per device, and its intra-op threading leaves cores idle on the small
matmuls and fusions of a CPU-sized model. Splitting the batch over one device per core (data
parallel, ``TrainConfig.mesh='auto'``) made the cpu-small train step about 1.2x faster on 2 cores
(docs/performance.md). So ``import jaxgpt`` asks XLA for one CPU device per core, up to
``AUTO_MAX``, unless the user has chosen: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
or ``JAXGPT_HOST_DEVICES=N`` (1 turns it off). It cannot apply once JAX has started its backend.
Accelerator backends are untouched: the flag only shapes the CPU platform.
"""
from __future__ import annotations

import os
import sys

ENV = "JAXGPT_HOST_DEVICES"
FLAG = "--xla_force_host_platform_device_count"
# Measured on 2 cores only; every device holds a replica of the params and optimizer state.
AUTO_MAX = 2


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # only asks; starts nothing

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


def default_host_devices() -> int | None:
    """Set XLA_FLAGS for ``requested()`` CPU devices; None when the user's flag or a started
    backend decides instead (nothing is changed then)."""
    if FLAG in os.environ.get("XLA_FLAGS", "") or _backend_started():
        return None
    n = requested()
    if n > 1:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}={n}".strip()
    return n


__all__ = ["AUTO_MAX", "ENV", "default_host_devices", "requested"]
