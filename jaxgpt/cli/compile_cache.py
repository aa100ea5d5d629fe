"""JAX's persistent compilation cache for jaxgpt's commands: a second ``jaxgpt train`` (or sample,
eval, serve) of the same model loads its compiled programs from disk instead of compiling them.

What it saves on nanoGPT's CPU run is in docs/performance.md (the persistent compilation cache row).

Where: ``$JAXGPT_COMPILE_CACHE`` (a folder, or ``off``), else ``$JAXGPT_CACHE/xla`` (default
``~/.cache/jaxgpt/xla``, beside the C++ kernels). A cache the user set for JAX itself
(``JAX_COMPILATION_CACHE_DIR``) is left as it is. Entries are keyed by the program, jax's version,
the devices and the compile options; a stale one is never loaded for a changed program.
Every program is cached, however fast it compiled (JAX's default keeps only the slow ones), and the
folder has no size cap: with one, JAX locks and scans the whole folder on every write.

Not cached across processes: programs that split the CPU attention kernel with
``custom_partitioning``, i.e. those whose split jit propagates (the train step with dropout, steps on a
tensor- or FSDP-split mesh; the data-parallel train and eval steps are shard_maps). JAX keys them
by a Python object's id, which differs per process. ``jax_remove_custom_partitioning_ptr_from_cache_key``
would leave the id out, but then two programs that differ only in a partitioning's static arguments
(the kernel's attention scale is one) would share an entry, so it stays off.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "JAXGPT_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")


def default_dir() -> Path:
    return Path(os.environ.get("JAXGPT_CACHE", Path.home() / ".cache" / "jaxgpt")) / "xla"


def enable(path: str | Path | None = None) -> Path | None:
    """Turn the cache on in this process (before its first compile) and return its folder; None
    when ``$JAXGPT_COMPILE_CACHE`` is ``off`` (or ``path`` is). ``path``: a folder instead of
    the environment's choice."""
    import jax

    if path is None and jax.config.jax_compilation_cache_dir:  # the user's own JAX setting
        return Path(jax.config.jax_compilation_cache_dir)
    value = (os.environ.get(ENV, "") if path is None else str(path)).strip()
    if value.lower() in OFF:
        return None
    where = Path(value).expanduser() if value else default_dir()
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", -1)
    return where


__all__ = ["ENV", "default_dir", "enable"]
