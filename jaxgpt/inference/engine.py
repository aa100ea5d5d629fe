"""Continuous batching over a paged KV cache (vLLM's scheduler, small).

Each ``step()``: admit waiting requests while pages and ``max_seqs`` allow; give every running
request that is decoding one token of the ``max_tokens_per_step`` budget, and the rest of it to
prefill chunks (chunked prefill, the chunk length chosen by ``paged_cache.plan_prefill`` to waste
few padded slots); allocate pages, preempting the latest admitted request when
they run out (its pages are freed and it is recomputed from its prompt and outputs later);
run one jitted call for all decode rows and one for the prefill chunks; sample per request;
finish on EOS, stop ids, stop strings, ``max_tokens`` or the context window, freeing pages.

Shapes come from power-of-two buckets (rows, tokens per row, pages per row; a prefill call at
most ``max(max_tokens_per_step, 64)`` padded token slots), so the programs form a fixed set
(``Engine.buckets()``); ``Engine.precompile()`` compiles them all ahead of time (``jaxgpt serve``
does at start), and ``Engine.compilations`` counts the ones compiled or run.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.inference.paged_cache import (MIN_CHUNK, MIN_PAGES, MIN_ROWS, PageAllocator, batch_arrays, bucket,
                                         init_pools, next_pow2, plan_prefill)
from jaxgpt.inference.sampling import SamplingParams, argmax, select_tokens
from jaxgpt.models.decoder import DecoderLM, unstack_layers
from jaxgpt.nn.kernels import paged_ffi
from jaxgpt.nn.kernels.paged import PAGED_KERNELS, PagedKVCache


@partial(jax.jit, static_argnames=("config", "kernel"), donate_argnums=(1,))
def paged_forward(params, pools, tokens, q_pos, slots, page_table, last, *, config, kernel="gather"):
    """One engine call: tokens (B, T) at positions q_pos (-1 = padding) -> (pools, greedy next
    tokens (B,), last-token logits (B, V)). The pools are donated: updated in place.

    Sampling is a second program (``sample``), run only when a row samples or wants logprobs: its
    sort doubled the compile time of every (B, T, P) shape, and it depends on B alone.
    """
    caches = tuple(PagedKVCache(k, v, page_table, slots, q_pos, ks, vs, config.dtype, kernel=kernel)
                   for k, v, ks, vs in pools)
    out = DecoderLM(config).apply({"params": params}, tokens, positions=jnp.maximum(q_pos, 0), cache=caches,
                                  logits_at=last)
    logits = out.logits[:, 0]  # (B, V)
    return tuple((c.k, c.v, c.k_scale, c.v_scale) for c in out.cache), argmax(logits), logits


sample = jax.jit(select_tokens)  # (B, V) logits + per-row settings -> tokens (B,), logprobs (B,)


def resolve_paged_kernel(kernel: str, compute_dtype: str, pool_dtype) -> str:
    """'auto' -> 'ffi' where the CPU kernel runs (CPU backend, float32 compute and pages, built),
    else 'gather'; an explicit 'ffi' that cannot run is an error, not a silent fallback."""
    if kernel not in PAGED_KERNELS:
        raise ValueError(f"paged_kernel={kernel!r} is not one of {PAGED_KERNELS}")
    if kernel == "gather":
        return kernel
    why = None
    if compute_dtype != "float32" or jnp.dtype(pool_dtype) != jnp.float32:
        why = f"it reads float32 pages in a float32 model (dtype={compute_dtype}, pages {jnp.dtype(pool_dtype)})"
    elif not paged_ffi.available():
        why = f"it is unavailable on this {jax.default_backend()} backend (see the warning)"
    if why is None:
        return "ffi"
    if kernel == "ffi":
        raise ValueError(f"paged_kernel='ffi' cannot run: {why}; use 'gather' or 'auto'")
    return "gather"


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the pages
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class RequestOutput:
    id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    error: str | None = None


class Engine:
    """Engine(config, params, max_seqs=, page_size=, num_pages=, max_tokens_per_step=).

    ``eos_ids``: tokens that end a request (unless its ``ignore_eos``); ``decode``: ids -> text,
    needed for stop strings. ``kv_dtype``: 'auto' (the compute dtype), 'float32', 'bfloat16', 'int8'.
    ``paged_kernel``: how attention reads the pages (PAGED_KERNELS): 'ffi' the CPU kernel
    (kernels/paged_ffi.py, float32 pages), 'gather' pure JAX, 'auto' the first where it can run.
    """

    def __init__(self, config, params, *, max_seqs: int = 32, page_size: int = 16, num_pages: int | None = None,
                 max_tokens_per_step: int = 512, kv_dtype: str = "auto", paged_kernel: str = "auto", eos_ids=(),
                 decode=None):
        if config.residual != "standard":
            raise ValueError(f"the engine needs a KV cache; residual={config.residual!r} models have none")
        for name, val in (("max_seqs", max_seqs), ("page_size", page_size), ("max_tokens_per_step",
                                                                             max_tokens_per_step)):
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        self.config, params = unstack_layers(config, params)
        # on the device once: host (NumPy) params would be copied into every step's call
        self.params = jax.device_put(params)
        self.page_size = page_size
        self.max_pages_per_seq = -(-config.max_len // page_size)
        if num_pages is None:
            num_pages = max_seqs * self.max_pages_per_seq + 1
        if num_pages - 1 < self.max_pages_per_seq:
            raise ValueError(f"num_pages={num_pages} cannot hold one full context ({config.max_len} tokens = "
                             f"{self.max_pages_per_seq} pages of {page_size}, plus the scratch page)")
        self.max_seqs, self.budget = max_seqs, max_tokens_per_step
        self._rows_hi, self._pages_hi = next_pow2(max_seqs), next_pow2(self.max_pages_per_seq)
        self._slots = max(next_pow2(max_tokens_per_step), MIN_ROWS * MIN_CHUNK)  # a prefill call's padded tokens
        self._chunk_hi = self._slots // MIN_ROWS  # the longest prefill chunk: MIN_ROWS rows of it fill the slots
        self.kv_dtype = kv_dtype
        self.pools = init_pools(self.config, num_pages, page_size, kv_dtype)
        self.paged_kernel = resolve_paged_kernel(paged_kernel, self.config.dtype, self.pools[0][0].dtype)
        self.allocator = PageAllocator(num_pages)
        self.eos_ids = set(int(i) for i in eos_ids)
        self.decode = decode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.stats = dict(steps=0, preemptions=0, prompt_tokens=0, generated_tokens=0, calls=0)
        self.shapes: set[tuple] = set()  # every (kind, B, T, P) shape run: the compilations

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
        v, n = self.config.vocab_size, self.config.max_len
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {v})")
        if len(ids) >= n:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context window is {n}, so at most {n - 1} "
                             f"leave room for one new token")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, next(self._arrival))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request (a client went away): its pages are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def compilations(self) -> int:
        return len(self.shapes)

    # -- scheduling ---------------------------------------------------------------------------------
    def _free(self, req: Request) -> None:
        self.allocator.release(req.pages)
        req.pages, req.computed = [], 0

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _grow(self, req: Request, upto: int) -> bool:
        need = self._pages_for(upto) - len(req.pages)
        if need <= 0:
            return True
        got = self.allocator.alloc(need)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _preempt(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self._free(victim)  # recomputed later from prompt + outputs: greedy tokens unchanged
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1
        return victim

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            first = min(len(req.tokens), self.budget)
            if self.allocator.free < self._pages_for(first) + len(self.running):  # keep a page of headroom each
                break
            self.waiting.popleft()
            self.running.append(req)

    def _schedule(self):
        """-> (decode rows, prefill rows) of (req, n_tokens); pages allocated for them."""
        budget = self.budget
        decode, prefill = [], []
        # decoding rows first (one token each keeps every stream moving), then prefill chunks, oldest first
        ready = sorted(self.running, key=lambda r: r.arrival)
        for req in [r for r in ready if len(r.tokens) - r.computed == 1]:
            if budget <= 0:
                break
            if self._take(req, 1):
                decode.append((req, 1))
                budget -= 1
        waiting = [r for r in ready if len(r.tokens) - r.computed > 1 and r in self.running]
        t, rows = plan_prefill([len(r.tokens) - r.computed for r in waiting], budget, MIN_CHUNK, self._chunk_hi,
                               self._rows_hi, self._slots)
        for req in waiting[:rows]:
            n = min(len(req.tokens) - req.computed, t, budget)
            if n > 0 and self._take(req, n):
                prefill.append((req, n))
                budget -= n
        live = set(id(r) for r in self.running)  # a later preemption may have hit an earlier row
        return [x for x in decode if id(x[0]) in live], [x for x in prefill if id(x[0]) in live]

    def _take(self, req: Request, n: int) -> bool:
        """Pages for req's next n tokens, preempting the latest admitted requests while they run out;
        False when req itself was preempted."""
        while req in self.running and not self._grow(req, req.computed + n):
            self._preempt()
        return req in self.running

    # -- running ------------------------------------------------------------------------------------
    def _shape(self, kind: str, n_rows: int, n_tokens: int, n_pages: int) -> tuple[str, int, int, int]:
        """(kind, B, T, P) of a call: a few padded rows, tokens or pages cost less than a compilation."""
        t = 1 if kind == "decode" else bucket(n_tokens, MIN_CHUNK, self._chunk_hi)  # <= the plan's T
        return kind, bucket(n_rows, MIN_ROWS, self._rows_hi), t, bucket(n_pages, MIN_PAGES, self._pages_hi)

    def buckets(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, B, T, P) shape ``step()`` can run: the programs it may compile."""
        rows = {self._shape("decode", n, 1, 1)[1] for n in range(1, self.max_seqs + 1)}
        pages = {self._shape("decode", 1, 1, n)[3] for n in range(1, self.max_pages_per_seq + 1)}
        tokens = {self._shape("prefill", 1, n, 1)[2] for n in range(1, self._chunk_hi + 1)}
        return sorted([("decode", b, 1, p) for b in rows for p in pages]
                      + [("prefill", b, t, p) for b in rows for t in tokens for p in pages if b * t <= self._slots])

    def precompile(self) -> int:
        """Compile every shape of ``buckets()`` now, so no request waits on a compilation; returns
        how many were compiled. Each runs once on padding rows, whose writes land on the scratch
        page, so the pools' contents are untouched (that run also fills jit's dispatch cache, which
        ahead-of-time ``lower().compile()`` leaves to a later trace)."""
        shapes = self.buckets()
        todo = [s for s in shapes if s not in self.shapes]
        for kind, b, t, p in todo:
            self._call(kind, b, t, p, [])
        for b in sorted({b for _, b, _, _ in shapes}):
            zeros = np.zeros((b, self.config.vocab_size), np.float32)
            np.asarray(sample(zeros, *self._sampling([], b), np.bool_(True))[0])
        return len(todo)

    def _sampling(self, rows, b: int):
        """Per-row sampling arrays (B,) for ``sample``: temperature, top_k, top_p, seed, counter."""
        sp = [r.params for r, _ in rows] + [SamplingParams()] * (b - len(rows))
        return (np.array([s.temperature for s in sp], np.float32), np.array([s.top_k for s in sp], np.int32),
                np.array([s.top_p for s in sp], np.float32), np.array([s.seed for s in sp], np.uint32),
                np.array([len(r.output) for r, _ in rows] + [0] * (b - len(rows)), np.int32))

    def _call(self, kind: str, b: int, t: int, p: int, rows):
        """Run shape (kind, B, T, P) on rows (req, n_tokens) -> (tokens (B,), logprobs (B,)) numpy."""
        self.shapes.add((kind, b, t, p))
        arrays = batch_arrays([(r.tokens[r.computed:r.computed + n], r.computed, r.pages) for r, n in rows],
                              self.page_size, b, t, p)
        self.pools, tok, logits = paged_forward(self.params, self.pools, *arrays, config=self.config,
                                                kernel=self.paged_kernel)
        want = any(r.params.logprobs for r, _ in rows)
        if not want and all(r.params.temperature == 0 for r, _ in rows):
            return np.asarray(tok), np.zeros(b, np.float32)
        tok, logp = sample(logits, *self._sampling(rows, b), np.bool_(want))
        return np.asarray(tok), np.asarray(logp)

    def _run(self, kind: str, rows):
        self.stats["calls"] += 1
        return self._call(*self._shape(kind, len(rows), max(n for _, n in rows),
                                       max(self._pages_for(r.computed + n) for r, n in rows)), rows)

    def step(self) -> list[RequestOutput]:
        """One scheduling round; returns what each request produced in it (streaming)."""
        self._admit()
        decode, prefill = self._schedule()
        outs: list[RequestOutput] = []
        for kind, rows in (("decode", decode), ("prefill", prefill)):
            if not rows:
                continue
            tok, logp = self._run(kind, rows)
            for i, (req, n) in enumerate(rows):
                req.computed += n
                if req.computed < len(req.tokens):  # a prefill chunk short of the end samples nothing
                    continue
                outs.append(self._append(req, int(tok[i]), float(logp[i])))
        self.stats["steps"] += 1
        return outs

    def _append(self, req: Request, tok: int, logp: float) -> RequestOutput:
        req.output.append(tok)
        req.logprobs.append(logp)
        self.stats["generated_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        try:
            req.finish_reason = self._finish_reason(req, tok)
        except Exception as e:  # one request's failure (a decode callable, a stop check) ends it alone
            req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
        if req.finish_reason is not None:
            self.running.remove(req)
            self._free(req)
            self.requests.pop(req.id, None)
        return RequestOutput(req.id, [tok], [logp], req.finish_reason is not None, req.finish_reason, req.error)

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            if self.decode is None:
                raise ValueError("stop strings need the engine's decode function (a tokenizer)")
            text = self.decode(req.output)
            if any(s in text for s in p.stop):
                return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.config.max_len:
            return "length"
        return None

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run prompts (lists of ids) to completion; returns each one's output ids, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        done: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.id in done:
                    done[o.id].extend(o.new_token_ids)
        return [done[i] for i in ids]
