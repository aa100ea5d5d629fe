"""Automatic prefix caching (vLLM's APC): full KV pages shared between requests whose tokens agree.

A full page is cached under a key (its parent's entry id, its ``page_size`` token ids). Entry ids
come from a counter and are never reused, so an id names one whole token prefix and a key match
is exact: no hash collision to trust. A request holding a page counts one reference; a cached
page no one holds stays cached, on an LRU list of evictable pages, until an allocation needs it
(truly free pages are handed out first).

Only pages whose every position is below the request's ``computed`` are cached, and a request
only ever writes at positions >= its ``computed``, so a shared page is never written: a request
always computes at least its last token itself, in a page of its own.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from jaxgpt.inference.paged_cache import PageAllocator
from jaxgpt.inference.requests import Request

ROOT = 0  # the parent id of a prompt's first page


class PrefixCachingAllocator(PageAllocator):
    """PageAllocator with reference counts and the cache: ``free`` counts the evictable pages too
    (an allocation may take them), ``cached`` the pages with a key."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages)
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._table: dict[tuple, tuple[int, int]] = {}  # (parent id, tokens) -> (entry id, page)
        self._key: dict[int, tuple] = {}  # cached page -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, LRU first
        self._ids = itertools.count(ROOT + 1)
        self.evictions = 0

    @property
    def free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def cached(self) -> int:
        return len(self._key)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int] | None:
        if n > self.free:
            return None
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:  # then the least recently used cached pages, forgetting their keys
            page, _ = self._evictable.popitem(last=False)
            del self._table[self._key.pop(page)]
            self.evictions += 1
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        # tail first: a prefix's later pages go before the pages they extend (an orphaned tail is unreachable)
        for p in reversed(pages):
            self._refs[p] -= 1
            if self._refs[p] > 0:
                continue
            if p in self._key:
                self._evictable[p] = None
            else:
                self._free.append(p)

    def match(self, tokens: list[int], max_pages: int) -> tuple[list[int], list[int]]:
        """The cached pages of ``tokens``' longest cached run of full pages (at most ``max_pages``),
        each with a reference taken -> (pages, their entry ids)."""
        ps, parent = self.page_size, ROOT
        pages, ids = [], []
        for i in range(max_pages):
            hit = self._table.get((parent, tuple(tokens[i * ps:(i + 1) * ps])))
            if hit is None:
                break
            parent, page = hit
            ids.append(parent)
            pages.append(page)
        for p in pages:
            self._evictable.pop(p, None)
            self._refs[p] += 1
        return pages, ids

    def register(self, page: int, parent: int, tokens: list[int]) -> int:
        """Cache ``page`` (full of ``tokens``, after the prefix entry ``parent`` names) -> its entry id.
        Tokens cached already (another request computed them at the same time) keep their page:
        this one stays private and goes back to the free list when released."""
        key = (parent, tuple(tokens))
        hit = self._table.get(key)
        if hit is not None:
            return hit[0]
        eid = next(self._ids)
        self._table[key] = (eid, page)
        self._key[page] = key
        return eid


def match_prefix(allocator: PrefixCachingAllocator, req: Request) -> int:
    """Give a request with no pages the cached pages of its tokens' prefix; -> tokens hit. At least
    the last token is left to compute (its logits sample the next one), so a fully cached run of
    pages loses its last page: that page is recomputed into one the request owns."""
    n = len(req.tokens)
    req.pages, req.chain = allocator.match(req.tokens, (n - 1) // allocator.page_size)
    req.computed = len(req.pages) * allocator.page_size
    return req.computed


def cache_full_pages(allocator: PrefixCachingAllocator, req: Request, upto: int | None = None) -> None:
    """Register the request's pages that have filled since the last call (prefill chunks and decode), up to
    token ``upto`` (default: its computed tokens; less where a draft model's pages lag behind)."""
    ps = allocator.page_size
    done = req.computed if upto is None else min(upto, req.computed)
    full = min(done, len(req.prompt) + len(req.output)) // ps  # a spec round's computed can pass a finish
    if full <= len(req.chain):
        return
    tokens = req.tokens
    for i in range(len(req.chain), full):
        req.chain.append(allocator.register(req.pages[i], req.chain[-1] if req.chain else ROOT,
                                            tokens[i * ps:(i + 1) * ps]))


def computed_by_another(req: Request, running: list[Request], page_size: int) -> bool:
    """Whether a running request is about to compute ``req``'s next full page (the same tokens up to
    its end): admitting req now would compute that page twice, waiting a step or two makes it a hit.
    Only prompt pages count (a request computes those in prefill chunks, many tokens a step)."""
    end = (len(req.chain) + 1) * page_size
    if end > len(req.tokens) - 1:  # no further page could be a hit
        return False
    head = None
    for r in running:
        if r.computed < end <= len(r.prompt):
            head = req.tokens[:end] if head is None else head
            if r.prompt[:end] == head:
                return True
    return False
