"""Host side of the paged KV cache: the device page pools, the free list, and the shape buckets.

Pools: per layer (num_pages, H_kv, page_size, D) keys and values (kernels/paged.py reads them),
in the compute dtype or int8 with float32 scales per token and head. Page 0 is scratch (padding
writes land there), so ``num_pages - 1`` pages are allocatable.
"""
from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.nn.kernels import gpu_paged, paged_ffi, tpu_ragged
from jaxgpt.nn.kernels.paged import PAGED_KERNELS

KV_DTYPES = ("auto", "float32", "bfloat16", "int8")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n, at least lo, at most hi (hi itself when n is above it)."""
    return min(max(next_pow2(n), lo), hi)


# The smallest buckets of an engine call's rows, prefill tokens per row and pages per row: a few
# padded rows, tokens or pages cost less than another compilation.
MIN_ROWS, MIN_CHUNK, MIN_PAGES = 4, 16, 4

# A step's fixed cost (reading every weight once, launching the program) in token slots, from the ratio of a
# decode step's time to a prefill slot's (docs/performance.md); rounded down, so the planner leans to fewer steps.
STEP_COST_SLOTS = 64


def plan_prefill(remaining: list[int], budget: int, lo: int, hi: int, max_rows: int,
                 max_slots: int) -> tuple[int, int]:
    """How to run one step's prefill: -> (T, rows), the first ``rows`` of ``remaining`` (prompt
    tokens left per request, oldest first) each taking min(left, T) tokens of ``budget``.

    The call's cost follows its padded slots, bucket(rows) x T, so a long chunk length wastes slots
    on short prompts and a short one splits long prompts over more steps. The plan maximises
    tokens / (slots + STEP_COST_SLOTS) over the T buckets [lo, hi] and row prefixes whose slots are
    at most ``max_slots`` (so the prefill shapes are a small fixed set); ties go to more tokens.
    Rows past the budget or ``max_rows`` wait for a later step (chunked prefill).
    """
    if not remaining or budget < 1:
        return lo, 0
    t = min(lo, hi)
    best = (-1.0, 0, -t, 0)  # (score, tokens, -T, rows)
    while t <= hi:
        left, tokens = budget, 0
        for r, rem in enumerate(remaining[:max_rows], 1):
            n = min(rem, t, left)
            tokens, left = tokens + n, left - n
            slots = bucket(r, MIN_ROWS, max_rows) * t
            if slots > max_slots:
                break
            score = tokens / (slots + STEP_COST_SLOTS)
            best = max(best, (score, tokens, -t, r))  # equal score and tokens: the shorter T
            if left == 0:
                break
        t *= 2
    return -best[2], best[3]


class PageAllocator:
    """The free list. Pages are ints in [1, num_pages); page 0 is never handed out."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def init_pools(config, num_pages: int, page_size: int, kv_dtype: str = "auto"):
    """Per layer (k, v, k_scale, v_scale): zeros; scales None unless kv_dtype == 'int8'."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {KV_DTYPES}")
    shape = (num_pages, config.kv_heads, page_size, config.head_dim)
    dtype = config.dtype if kv_dtype == "auto" else kv_dtype
    pools = []
    for _ in range(config.n_layer):
        if dtype == "int8":
            scale = jnp.zeros(shape[:-1], jnp.float32)
            pools.append((jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scale, scale.copy()))
        else:
            pools.append((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None))
    return tuple(pools)


def pool_bytes(pools) -> int:
    return int(sum(a.nbytes for layer in pools for a in layer if a is not None))


def page_bytes(config, page_size: int, kv_dtype: str = "auto") -> int:
    """Bytes one page takes over all layers: keys and values, plus int8's float32 scales."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {KV_DTYPES}")
    dtype = config.dtype if kv_dtype == "auto" else kv_dtype
    per_token = config.kv_heads * config.head_dim * jnp.dtype(dtype).itemsize + (
        config.kv_heads * 4 if dtype == "int8" else 0)
    return 2 * config.n_layer * page_size * per_token


def device_memory_bytes(device=None) -> int:
    """An accelerator's memory (``memory_stats()['bytes_limit']``); on the CPU, physical RAM."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_budget(budget, device=None) -> int:
    """Bytes from an int (bytes), a size string ('4GiB', '512MiB', '1.5GB') or a fraction in
    (0, 1] of the device's memory (0.3 or '0.3'). A bare number above 1 is refused: no unit."""
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        unit = m and m.group(2).lower()
        if not m or (unit and unit not in _UNITS):
            raise ValueError(f"KV cache memory {budget!r} is neither a size (e.g. 4GiB, 512MiB) nor a fraction of "
                             f"the device's memory (e.g. 0.3)")
        if unit:
            return int(float(m.group(1)) * _UNITS[unit])
        budget = float(m.group(1))
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"KV cache memory {budget} as a fraction of the device's memory must be in (0, 1]; "
                             f"give a size with a unit (e.g. 4GiB) otherwise")
        return int(budget * device_memory_bytes(device))
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"KV cache memory must be a positive number of bytes, a size or a fraction, got {budget!r}")
    return budget


def pages_for_budget(config, page_size: int, kv_dtype: str, budget, *, max_model_len: int | None = None,
                     draft_config=None, device=None) -> int:
    """``num_pages`` (scratch page included) whose pools fit ``budget`` (``parse_budget``), counting
    the draft's pools too (it keeps one page per target page). Raises when the budget cannot hold
    one full context of ``max_model_len`` (default ``config.max_len``) tokens."""
    want = parse_budget(budget, device)
    per_page = page_bytes(config, page_size, kv_dtype) + (
        page_bytes(draft_config, page_size, kv_dtype) if draft_config is not None else 0)
    num_pages = want // per_page
    n = max_model_len or config.max_len
    need = -(-n // page_size) + 1
    if num_pages < need:
        raise ValueError(f"KV cache memory {budget!r} = {want} bytes holds {num_pages} pages of {per_page} bytes "
                         f"({page_size} tokens{', target + draft' if draft_config is not None else ''}); one full "
                         f"context of {n} tokens needs {need} pages with the scratch page = {need * per_page} bytes")
    return int(num_pages)


def batch_arrays(rows, page_size: int, b: int, t: int, p: int):
    """Host arrays for one call: rows are (tokens, start_pos, pages). Returns tokens, q_pos, slots,
    page_table, last (index of each row's last real token), all int32 numpy."""
    tokens = np.zeros((b, t), np.int32)
    q_pos = np.full((b, t), -1, np.int32)
    slots = np.zeros((b, t), np.int32)
    table = np.zeros((b, p), np.int32)
    last = np.zeros((b,), np.int32)
    for i, (toks, start, pages) in enumerate(rows):
        n = len(toks)
        tokens[i, :n] = toks
        pos = np.arange(start, start + n)
        q_pos[i, :n] = pos
        pg = np.asarray(pages, np.int32)
        table[i, :len(pg)] = pg[:p]
        slots[i, :n] = pg[pos // page_size] * page_size + pos % page_size
        last[i] = n - 1
    return tokens, q_pos, slots, table, last


@functools.cache
def _fallback_warning(why: str) -> None:
    warnings.warn(f"paged_kernel='auto' runs 'gather' (each layer copies every row's pages into one array): the "
                  f"in-place paged kernel cannot run, because {why}", stacklevel=4)


def resolve_paged_kernel(kernel: str, compute_dtype: str, pool_dtype, head_dim: int = 64, page_size: int = 16,
                         attn_softcap: float | None = None) -> str:
    """The paged kernel an engine on this machine runs (kernels/paged_dispatch.py picks each
    platform's kernel for 'auto' when the program is lowered). 'auto' stays 'auto', with one warning
    per reason where this machine's platform gathers (a fallback is never silent): on the CPU the
    C++ kernel needs float32 pages in a float32 model and a compiler; on a GPU the Pallas kernel
    needs power-of-two head_dim and page_size; on a TPU, float32, bfloat16 or int8 pools (tpu_ragged.py).
    An explicit 'ffi' or 'pallas' that cannot run here is an error; 'pallas' on the CPU runs in
    Pallas' interpret mode (tests). No in-place kernel has score soft-capping: with ``attn_softcap``
    'auto' gathers."""
    if kernel not in PAGED_KERNELS:
        raise ValueError(f"paged_kernel={kernel!r} is not one of {PAGED_KERNELS}")
    if kernel == "gather":
        return kernel
    if attn_softcap is not None:
        why = f"it has no attention soft-capping (attn_softcap={attn_softcap})"
        if kernel != "auto":
            raise ValueError(f"paged_kernel={kernel!r} cannot run: {why}; use 'gather' or 'auto'")
        _fallback_warning(why)
        return "gather"
    backend = jax.default_backend()  # the machine the engine runs its programs on
    ffi_why = None
    if backend != "cpu":
        ffi_why = f"it is a CPU kernel and this backend is {backend!r}"
    elif compute_dtype != "float32" or np.dtype(pool_dtype) != np.float32:
        ffi_why = f"it reads float32 pages in a float32 model (dtype={compute_dtype}, pages {np.dtype(pool_dtype)})"
    elif not paged_ffi.available():
        ffi_why = f"it is unavailable on this {backend} backend (see the warning)"
    q = jax.ShapeDtypeStruct((1, 1, 1, head_dim), jnp.dtype(compute_dtype))
    pool = jax.ShapeDtypeStruct((1, 1, page_size, head_dim), np.dtype(pool_dtype))
    pallas_why = gpu_paged.unsupported(q, pool)
    if kernel == "ffi" and ffi_why is not None:
        raise ValueError(f"paged_kernel='ffi' cannot run: {ffi_why}; use 'gather' or 'auto'")
    if kernel == "pallas" and (pallas_why is not None or backend not in ("cpu", "gpu")):
        why = pallas_why or f"it runs on CUDA (interpreted on the CPU), and this backend is {backend!r}"
        raise ValueError(f"paged_kernel='pallas' cannot run: {why}; use 'gather' or 'auto'")
    if kernel == "auto":
        why = {"cpu": ffi_why, "gpu": pallas_why, "tpu": tpu_ragged.unsupported(q, pool)}.get(
            backend, f"no in-place paged kernel runs on {backend!r} yet")
        if why is not None:
            _fallback_warning(why)
    return kernel
