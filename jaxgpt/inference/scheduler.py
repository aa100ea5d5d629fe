"""The engine's bookkeeping, apart from the programs it runs: requests (waiting, running), their KV
pages (allocation, prefix caching, preemption) and each step's plan of rows within the token budget.

Admission takes waiting requests while pages and ``max_seqs`` allow, first handing each the cached
full pages of its prefix (prefix_cache.py). ``schedule`` gives every decoding request one token of
the ``max_tokens_per_step`` budget (k + 1 when it speculates: below ``spec_max_batch`` running requests,
or where ``spec_policy.SpecPolicy``'s measurements say it pays) and the rest to prefill chunks, the
chunk length chosen by ``paged_cache.plan_prefill`` to waste few padded slots. When pages run out,
the latest admitted request is preempted: its pages are freed (and stay cached) and it is
recomputed from its prompt and outputs later. ``Engine`` (engine.py) holds a Scheduler and runs the
rows it plans, in the shapes it buckets them into (``shape``, ``buckets``).

Sliding windows (``window``: every layer's, set only where every layer slides): a request's pages
wholly before the window of its next query are released as it goes (``_drop_outside_window``), their
page-table entries pointed at the scratch page, so its pages stop growing past the window.
"""
from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from jaxgpt.inference import prefix_cache, speculative
from jaxgpt.inference.paged_cache import (MIN_CHUNK, MIN_PAGES, MIN_ROWS, PageAllocator, bucket, next_pow2,
                                          plan_prefill)
from jaxgpt.inference.requests import Request
from jaxgpt.inference.sampling import SamplingParams, fresh_seed
from jaxgpt.inference.spec_policy import SpecPolicy


class Scheduler:
    """Requests and pages for an engine of ``max_seqs`` rows, ``num_pages`` pages of ``page_size``
    tokens and ``budget`` tokens a step; token ids in [0, ``vocab``), sequences of at most
    ``max_model_len`` tokens. ``k``: speculative proposals a round (None: no draft model), taken
    while at most ``spec_max_batch`` requests run, or with 'auto' where ``spec_policy`` (a
    ``SpecPolicy``) decides from measured acceptance and call times."""

    def __init__(self, *, vocab: int, max_model_len: int, max_seqs: int, page_size: int, num_pages: int, budget: int,
                 prefix_caching: bool, k: int | None, spec_max_batch: int | str, window: int | None = None):
        self.vocab, self.max_model_len, self.max_seqs, self.page_size, self.budget = (vocab, max_model_len, max_seqs,
                                                                                       page_size, budget)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self._rows_hi, self._pages_hi = next_pow2(max_seqs), next_pow2(self.max_pages_per_seq)
        self._slots = max(next_pow2(budget), MIN_ROWS * MIN_CHUNK)  # a prefill call's padded tokens
        self._chunk_hi = self._slots // MIN_ROWS  # the longest prefill chunk: MIN_ROWS rows of it fill the slots
        self.prefix_caching = prefix_caching
        self.allocator = (prefix_cache.PrefixCachingAllocator(num_pages, page_size) if prefix_caching
                          else PageAllocator(num_pages))
        self.k, self.spec_max_batch = k, spec_max_batch
        self.spec_policy = SpecPolicy(k) if k is not None and spec_max_batch == "auto" else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        # prefix_queries, prefix_hits: tokens looked up in the prefix cache at admission, and found
        self.stats = dict(preemptions=0, prompt_tokens=0, prefix_queries=0, prefix_hits=0)
        if k is not None:
            self.stats.update(spec_off_steps=0)
        self.draft_at: dict[str, int] = {}  # requests whose draft pages hold only their first n tokens
        self.window = window

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
        v, n = self.vocab, self.max_model_len
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {v})")
        if len(ids) >= n:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context window is {n}, so at most {n - 1} "
                             f"leave room for one new token")
        bad = [i for i, _ in params.logit_bias if i >= v]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {v})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        # an unseeded request gets fresh entropy (OpenAI's behaviour), kept on the Request to rerun it
        seed = fresh_seed() if params.seed is None else params.seed
        req = Request(rid, ids, params, next(self._arrival), seed=seed, adjust=dict(params.logit_bias))
        self.requests[rid] = req
        self.waiting.append(req)
        self.stats["prompt_tokens"] += len(ids)
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

    def finish(self, req: Request) -> None:
        """req has finished: out of the batch, its pages freed (and cached)."""
        self.running.remove(req)
        self._free(req)
        self.requests.pop(req.id, None)

    # -- shapes -------------------------------------------------------------------------------------
    def shape(self, kind: str, n_rows: int, n_tokens: int, n_pages: int) -> tuple[str, int, int, int]:
        """(kind, B, T, P) of a call: a few padded rows, tokens or pages cost less than a compilation.
        A speculative row is k + 1 tokens, so its rows start at 1: at batch 1, where speculation pays,
        three padding rows would cost three rows of target work."""
        t = {"decode": 1, "spec": n_tokens}.get(kind) or bucket(n_tokens, MIN_CHUNK, self._chunk_hi)  # <= the plan's T
        b = bucket(n_rows, 1 if kind == "spec" else MIN_ROWS, self._rows_hi)
        return kind, b, t, bucket(n_pages, MIN_PAGES, self._pages_hi)

    def rows_shape(self, kind: str, rows) -> tuple[str, int, int, int]:
        """The shape of a call over rows (req, n_tokens)."""
        return self.shape(kind, len(rows), max(n for _, n in rows),
                          max(self._pages_for(r.computed + n) for r, n in rows))

    def buckets(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, B, T, P) shape a step can run: the programs an engine may compile."""
        rows = {self.shape("decode", n, 1, 1)[1] for n in range(1, self.max_seqs + 1)}
        pages = {self.shape("decode", 1, 1, n)[3] for n in range(1, self.max_pages_per_seq + 1)}
        tokens = {self.shape("prefill", 1, n, 1)[2] for n in range(1, self._chunk_hi + 1)}
        spec_rows = {self.shape("spec", n, 1, 1)[1] for n in range(1, self.max_seqs + 1)}
        spec = [("spec", b, self.k + 1, p) for b in spec_rows for p in pages] if self.k is not None else []
        return sorted([("decode", b, 1, p) for b in rows for p in pages] + spec
                      + [("prefill", b, t, p) for b in rows for t in tokens for p in pages if b * t <= self._slots])

    # -- the draft's catch-up -----------------------------------------------------------------------
    def catch_up_plan(self, reqs) -> tuple[list, tuple[str, int, int, int]]:
        """The draft's next catch-up call for reqs (each in ``draft_at``): rows (req, at, n tokens from
        at) and the prefill shape they run in; MIN_ROWS rows of the longest chunk fit its slots."""
        rows = [(req, self.draft_at[req.id], min(req.computed - self.draft_at[req.id], self._chunk_hi))
                for req in reqs[:MIN_ROWS]]
        return rows, self.shape("prefill", len(rows), max(n for *_, n in rows),
                                max(self._pages_for(at + n) for _, at, n in rows))

    def caught_up(self, rows) -> None:
        """The draft's pages now hold the rows' tokens (catch_up_plan's rows)."""
        for req, at, n in rows:
            self.draft_at[req.id] = at + n
            if at + n == req.computed:
                del self.draft_at[req.id]

    # -- scheduling ---------------------------------------------------------------------------------
    def _free(self, req: Request) -> None:
        self._cache(req)  # a finished or preempted request's pages stay cached, evictable
        self.allocator.release([p for p in req.pages if p])  # 0: a page already dropped outside the window
        req.pages, req.computed, req.chain = [], 0, []  # a recompute prefills the draft too
        self.draft_at.pop(req.id, None)

    def _cache(self, req: Request) -> None:
        # with a draft, only pages whose draft keys/values were written too: a request that took plain decode
        # steps (speculation was off for its batch) has draft pages up to draft_at until it catches up
        if self.prefix_caching:
            upto = self.draft_at.get(req.id, req.computed) if self.k is not None else req.computed
            prefix_cache.cache_full_pages(self.allocator, req, upto)

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

    def admit(self) -> None:
        for req in self.running:
            self._cache(req)
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            if self.prefix_caching:
                prefix_cache.match_prefix(self.allocator, req)
            need = self._pages_for(min(len(req.tokens), req.computed + self.budget)) - len(req.pages)
            if (self.allocator.free < need + len(self.running)  # keep a page of headroom each
                    or self.prefix_caching and prefix_cache.computed_by_another(req, self.running, self.page_size)):
                self._free(req)  # a page another request is computing: wait a step for it, not compute it twice
                break
            self.stats["prefix_queries"] += len(req.tokens) if self.prefix_caching else 0
            self.stats["prefix_hits"] += req.computed
            self.waiting.popleft()
            self.running.append(req)

    def _can_speculate(self, req: Request) -> bool:
        return (self.k is not None and speculative.supports(req.params)
                and req.computed + self.k + 1 <= self.max_model_len)  # a round writes computed .. computed + k

    def spec_bucket(self, n_rows: int) -> int:
        """The batch size bucket the auto rule keys its measurements by: the speculative call's row bucket."""
        return bucket(n_rows, 1, self._rows_hi)

    def _spec_on(self, n_rows: int) -> bool:
        """Whether this step's n_rows decoding rows that can speculate do: the fixed rule counts every
        running request; the auto rule asks the policy about the rows' bucket (once a step)."""
        if self.spec_policy is None:
            return len(self.running) <= self.spec_max_batch
        return self.spec_policy.speculates(self.spec_bucket(n_rows))

    def schedule(self):
        """-> (speculative rows, decode rows, prefill rows) of (req, n_tokens); pages allocated for them."""
        budget = self.budget
        spec, decode, prefill = [], [], []
        # decoding rows first (a token or a round each keeps every stream moving), then prefill chunks, oldest first
        ready = sorted(self.running, key=lambda r: r.arrival)
        decoding = [r for r in ready if len(r.tokens) - r.computed == 1]
        can = {id(r) for r in decoding if self._can_speculate(r)}
        on = bool(can) and self._spec_on(len(can))
        if can and not on:
            self.stats["spec_off_steps"] += 1
        for req in decoding:
            n = self.k + 1 if on and id(req) in can else 1
            if budget < n:
                break
            if self._take(req, n):
                (spec if n > 1 else decode).append((req, n))
                if self.k is not None and n == 1:  # the draft's pages fall behind from here
                    self.draft_at.setdefault(req.id, req.computed)
                budget -= n
        waiting = [r for r in ready if len(r.tokens) - r.computed > 1 and r in self.running]
        t, rows = plan_prefill([len(r.tokens) - r.computed for r in waiting], budget, MIN_CHUNK, self._chunk_hi,
                               self._rows_hi, self._slots)
        for req in waiting[:rows]:
            n = min(len(req.tokens) - req.computed, t, budget)
            if n > 0 and self._take(req, n):
                prefill.append((req, n))
                budget -= n
        live = set(id(r) for r in self.running)  # a later preemption may have hit an earlier row
        return tuple([x for x in rows if id(x[0]) in live] for rows in (spec, decode, prefill))

    def _drop_outside_window(self, req: Request) -> None:
        """Release req's pages whose every position is before the sliding window of its next query
        (position req.computed sees keys > computed - window): no later query reads them. Their
        entries become 0, the scratch page, which attention masks (or, in the C++ kernel, never
        reads). With prefix caching, only pages already cached (they stay cached, evictable)."""
        if self.window is None:
            return
        drop = max(0, req.computed - self.window + 1) // self.page_size
        if self.prefix_caching:
            drop = min(drop, len(req.chain))
        gone = [p for p in req.pages[:drop] if p]
        if gone:
            self.allocator.release(gone)
            req.pages[:drop] = [0] * drop

    def _take(self, req: Request, n: int) -> bool:
        """Pages for req's next n tokens, preempting the latest admitted requests while they run out;
        False when req itself was preempted."""
        self._drop_outside_window(req)
        while req in self.running and not self._grow(req, req.computed + n):
            self._preempt()
        return req in self.running

