"""Multi-host runs (``jax.distributed``): who writes the run directory, and where processes wait for each other.

Every process runs the same program on its share of the devices; files that describe the whole
run (``metrics.jsonl``, ``loss.png``, a checkpoint step's ``jaxgpt_files.json``, a damaged step
moved aside) are written by process 0 alone, so a shared run directory gets one copy of each.
Orbax's own saves, deletes and reads are called on every process (they hold barriers inside and
each process writes its own shards). On one process both helpers cost nothing.
"""
from __future__ import annotations

import jax


def is_primary() -> bool:
    """True on the process that writes the run directory's shared files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process has reached ``barrier(name)`` (a no-op on one process). Every
    process must call it, with the same name, the same number of times."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["barrier", "is_primary"]
