"""Continuous batching over a paged KV cache, in vLLM's shape: an ``Engine`` holds a ``Scheduler``
(scheduler.py: requests, pages, admission, preemption, each step's plan of rows), a ``ModelRunner``
(model_runner.py: the compiled programs over the model's parameters and page pools) and, for
speculative decoding, a ``DraftRunner`` (draft_runner.py); when a request stops is a ``StopChecker``'s
decision (stopping.py).

Each ``step()``: admit waiting requests while pages and ``max_seqs`` allow; give every running
request that is decoding one token of the ``max_tokens_per_step`` budget, and the rest of it to
prefill chunks (chunked prefill, the chunk length chosen by ``paged_cache.plan_prefill`` to waste
few padded slots); allocate pages, preempting the latest admitted request when
they run out (its pages are freed and it is recomputed from its prompt and outputs later);
run one jitted call for all decode rows and one for the prefill chunks; sample per request;
finish on EOS, stop ids, stop strings, ``max_tokens`` or the context window, freeing pages.
With prefix caching (on by default) admission first hands a request the cached full pages of its
tokens' prefix, and freed full pages stay cached until evicted (prefix_cache.py).

With a ``draft`` model (speculative decoding) every decoding row takes k + 1 tokens of the budget
instead, and one program (``speculative.speculate``) runs the round for all of them: the draft
proposes k tokens a row, the target scores them, and each row emits its accepted drafts plus one
token. The draft keeps its own pools under the same page ids, filled by the same prefill chunks;
a rejected tail needs no rewind, since ``computed`` moves past the accepted tokens only and later
writes overwrite the rest.
With ``spec_max_batch='auto'`` (the default) each step speculates where the measured acceptance
and call times say a round yields more tokens a second than plain steps at that batch size
(``spec_policy.SpecPolicy``); an int speculates while at most that many requests run.

Shapes come from power-of-two buckets (rows, tokens per row, pages per row; a prefill call at
most ``max(max_tokens_per_step, 64)`` padded token slots), so the programs form a fixed set
(``Engine.buckets()``); ``Engine.precompile()`` compiles them all ahead of time (``jaxgpt serve``
does at start), and ``Engine.compilations`` counts the ones compiled or run.
"""
from __future__ import annotations

import time
import types

import numpy as np

from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.draft_runner import DraftRunner
from jaxgpt.inference.model_runner import ModelRunner
from jaxgpt.inference.paged_cache import batch_arrays
from jaxgpt.inference.paged_model import paged_forward
from jaxgpt.inference.requests import Request, RequestOutput
from jaxgpt.inference.sampling import SamplingParams, batch_settings, sample_requests
from jaxgpt.inference.scheduler import Scheduler
from jaxgpt.inference.stopping import StopChecker

# 'auto': speculate where measured acceptance and call times say it pays (spec_policy.py); the crossover
# batch size moves with the acceptance rate (docs/serving.md), so no fixed int is right for every pair.
SPEC_MAX_BATCH = "auto"


def _part(owner: str, name: str, doc: str = "") -> property:
    """A read-only attribute of one of the engine's parts, kept on the engine (its public API)."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=doc or f"``{owner}.{name}``")


def _check_sizes(config, *, max_seqs, page_size, max_tokens_per_step, max_model_len, spec_max_batch) -> None:
    if config.residual != "standard":
        raise ValueError(f"the engine needs a KV cache; residual={config.residual!r} models have none")
    for name, val in (("max_seqs", max_seqs), ("page_size", page_size), ("max_tokens_per_step", max_tokens_per_step)):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if not 2 <= max_model_len <= config.max_len:
        raise ValueError(f"max_model_len={max_model_len} must be in [2, {config.max_len}]: the model's "
                         f"context is {config.max_len} tokens, and a request needs a prompt token and an output")
    if not (spec_max_batch == "auto" or type(spec_max_batch) is int and spec_max_batch >= 1):  # not a bool
        raise ValueError(f"spec_max_batch must be 'auto' or an int >= 1, got {spec_max_batch!r}")


def _num_pages(num_pages, *, max_seqs, page_size, max_model_len, window, budget) -> int:
    """The pool's pages (default: max_seqs full contexts and the scratch page), checked to hold one context."""
    pages_per_seq = -(-max_model_len // page_size)
    if window is not None:  # a request holds its window's pages and one step's chunk at most
        pages_per_seq = min(pages_per_seq, -(-(window - 1 + budget) // page_size) + 1)
    if num_pages is None:
        num_pages = max_seqs * pages_per_seq + 1
    if num_pages - 1 < pages_per_seq:
        raise ValueError(f"num_pages={num_pages} cannot hold one full context ({max_model_len} tokens = "
                         f"{pages_per_seq} pages of {page_size}, plus the scratch page"
                         f"{'; a sliding window: its keys and one step' if window is not None else ''})")
    return num_pages


class Engine:
    """Engine(config, params, max_seqs=, page_size=, num_pages=, max_tokens_per_step=).

    ``eos_ids``: tokens that end a request (unless its ``ignore_eos``); ``decode``: ids -> text,
    needed for stop strings (checked incrementally, detokenize.Detokenizer: O(1) a token).
    ``max_model_len``: the longest sequence (prompt + output) served, at most the model's
    ``max_len`` (the default); it sets the pages a sequence may hold.
    ``kv_dtype``: 'auto' (the compute dtype), 'float32', 'bfloat16', 'int8'.
    ``draft``: (config, params) of a smaller model with the same vocabulary, for speculative
    decoding with ``num_speculative_tokens`` proposals a round. ``spec_max_batch``: 'auto' decides
    each step from measured acceptance and call times (``self.spec_policy``, spec_policy.py); an
    int speculates while at most that many requests are running. Otherwise rows take plain decode steps.
    ``paged_kernel``: how attention reads the pages (PAGED_KERNELS): 'ffi' the C++ CPU kernel
    (float32 pages), 'pallas' the CUDA kernel (kernels/gpu_paged.py; in Pallas' interpret mode on
    the CPU, for tests), 'gather' pure JAX, 'auto' each platform's kernel where it can run
    (kernels/paged_dispatch.py, chosen when the program is lowered).
    ``enable_prefix_caching``: full KV pages of shared prefixes are reused (prefix_cache.py).
    ``head_kernel``: how the vocabulary projection runs (packed_head.HEAD_KERNELS): 'panel' the CPU
    kernel over a packed copy of the head's weight (which then replaces the lm_head in the engine's
    params), 'xla' the model's own, 'auto' the kernel where it can run and measured faster here.

    Its parts: ``scheduler`` (a Scheduler), ``runner`` (a ModelRunner), ``draft`` (a DraftRunner or None).
    """

    def __init__(self, config, params, *, max_seqs: int = 32, page_size: int = 16, num_pages: int | None = None,
                 max_tokens_per_step: int = 512, kv_dtype: str = "auto", paged_kernel: str = "auto", eos_ids=(),
                 decode=None, draft=None, num_speculative_tokens: int = 4, max_model_len: int | None = None,
                 spec_max_batch: int | str = SPEC_MAX_BATCH, enable_prefix_caching: bool = True,
                 head_kernel: str = "auto"):
        max_model_len = config.max_len if max_model_len is None else max_model_len
        _check_sizes(config, max_seqs=max_seqs, page_size=page_size, max_tokens_per_step=max_tokens_per_step,
                     max_model_len=max_model_len, spec_max_batch=spec_max_batch)
        # the window past which a request's pages are released (Scheduler._drop_outside_window): the model's,
        # where every layer slides and no draft model (whose pools share the page ids) reads them
        window = config.sliding_window if config.window_layers is None and draft is None else None
        num_pages = _num_pages(num_pages, max_seqs=max_seqs, page_size=page_size, max_model_len=max_model_len,
                               window=window, budget=max_tokens_per_step)
        k = None if draft is None else num_speculative_tokens
        # token_vocab: a padded table's extra rows are no tokens
        self.scheduler = Scheduler(vocab=config.token_vocab, max_model_len=max_model_len, max_seqs=max_seqs,
                                   page_size=page_size, num_pages=num_pages, budget=max_tokens_per_step,
                                   prefix_caching=enable_prefix_caching, k=k, spec_max_batch=spec_max_batch,
                                   window=window)
        pools = dict(num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype, paged_kernel=paged_kernel,
                     head_kernel=head_kernel)
        self.runner = ModelRunner(config, params, **pools)
        self.draft = None if draft is None else DraftRunner(*draft, target_config=config, max_model_len=max_model_len,
                                                            k=k, budget=max_tokens_per_step, **pools)
        self.kv_dtype, self.eos_ids, self.decode = kv_dtype, frozenset(int(i) for i in eos_ids), decode
        self._stops: dict[str, StopChecker] = {}  # per running request
        self.shapes: set[tuple] = set()  # every (kind, B, T, P) shape run: the compilations
        self._stats = dict(steps=0, generated_tokens=0, calls=0)
        if draft is not None:
            self._stats.update(spec_proposed=0, spec_accepted=0, spec_catch_up_tokens=0, spec_rounds=0)

    # the parts' state, read where the engine was read before it had parts
    config = _part("runner", "config", "the model's config")
    params = _part("runner", "params")
    pools = _part("runner", "pools")
    head = _part("runner", "head", "the packed vocabulary projection, or None")
    head_kernel = _part("runner", "head_kernel")
    paged_kernel = _part("runner", "kernel", "the resolved paged attention kernel")
    allocator = _part("scheduler", "allocator")
    requests = _part("scheduler", "requests")
    running = _part("scheduler", "running")
    waiting = _part("scheduler", "waiting")
    spec_policy = _part("scheduler", "spec_policy")
    spec_max_batch = _part("scheduler", "spec_max_batch")
    max_model_len = _part("scheduler", "max_model_len")
    max_pages_per_seq = _part("scheduler", "max_pages_per_seq")
    page_size = _part("scheduler", "page_size")

    @property
    def stats(self) -> dict:
        """Counters, a snapshot: the scheduler's (admission, preemption, prefix cache) and the engine's (steps,
        calls, tokens, speculation)."""
        return {**self.scheduler.stats, **self._stats}

    @property
    def compilations(self) -> int:
        return len(self.shapes)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        return self.scheduler.add_request(prompt_ids, params, request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (a client went away): its pages are freed at once."""
        self._stops.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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

    # -- programs -----------------------------------------------------------------------------------
    def buckets(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, B, T, P) shape ``step()`` can run: the programs it may compile."""
        return self.scheduler.buckets()

    def precompile(self) -> int:
        """Compile every shape of ``buckets()`` now, so no request waits on a compilation; returns
        how many were compiled. Each runs once on padding rows, whose writes land on the scratch
        page, so the pools' contents are untouched (that run also fills jit's dispatch cache, which
        ahead-of-time ``lower().compile()`` leaves to a later trace)."""
        shapes = self.buckets()
        todo = [s for s in shapes if s not in self.shapes]
        for kind, b, t, p in todo:
            self._call(kind, b, t, p, [])
        for b in sorted({b for _, b, _, _ in shapes}):  # the plain sampling variant; the others on first use
            np.asarray(self._sample(np.zeros((b, self.config.vocab_size), np.float32), [], b)[0])
        return len(todo)

    def _sample(self, logits, rows, b: int):
        return sample_requests(logits, [r for r, _ in rows], b, self.config.vocab_size)

    def _call(self, kind: str, b: int, t: int, p: int, rows):
        """Run shape (kind, B, T, P) on rows (req, n_tokens) -> (tokens (B,), logprobs (B,)) numpy and
        each row's top logprobs (a list of (id, logprob) pairs); a speculative round -> ``_spec_call``'s."""
        self.shapes.add((kind, b, t, p))
        if kind == "spec":
            return self._spec_call(b, p, rows)
        arrays = batch_arrays([(r.tokens[r.computed:r.computed + n], r.computed, r.pages) for r, n in rows],
                              self.page_size, b, t, p)
        tok, logits = self.runner.forward(*arrays)
        if kind == "prefill" and self.draft is not None:  # the draft's pages follow the same chunks
            self.draft.follow(*arrays)
        if all(r.params.temperature == 0 and not r.params.logprobs and not r.adjust for r, _ in rows):
            return np.asarray(tok), np.zeros(b, np.float32), [[] for _ in rows]  # the forward's argmax will do
        return self._sample(logits, rows, b)

    def _spec_call(self, b: int, p: int, rows):
        """One speculative round for rows (req, k+1) -> (n accepted (B,), emitted (B, k+1), logprobs (B, k+1))."""
        last = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        table = np.zeros((b, p), np.int32)
        for i, (r, _) in enumerate(rows):
            last[i], pos[i] = r.tokens[r.computed], r.computed
            table[i, :len(r.pages)] = r.pages[:p]
        return self.draft.speculate(self.runner, last, pos, table, batch_settings([r for r, _ in rows], b))

    def _run(self, kind: str, rows):
        self._stats["calls"] += 1
        shape = self.scheduler.rows_shape(kind, rows)
        # the auto rule's samples; a first call's time is its compilation's
        timed = self.spec_policy is not None and kind != "prefill" and shape in self.shapes
        if timed:  # the draft's queued prefill chunk or catch-up is neither mode's cost: a catch-up before every
            self.draft.wait()  # re-explored round would keep speculation off
        t0 = time.perf_counter()
        out = self._call(*shape, rows)  # returns host arrays: the time includes the device's work
        if timed:
            self.spec_policy.record_time(kind == "spec", self.scheduler.spec_bucket(len(rows)),
                                         time.perf_counter() - t0)
        return out

    # -- a step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling round; returns what each request produced in it (streaming)."""
        self.scheduler.admit()
        spec, decode, prefill = self.scheduler.schedule()
        outs: list[RequestOutput] = []
        if spec:
            self._catch_up([r for r, _ in spec if r.id in self.scheduler.draft_at])
            outs += self._accept(spec, *self._run("spec", spec))
        for kind, rows in (("decode", decode), ("prefill", prefill)):
            if not rows:
                continue
            tok, logp, tops = self._run(kind, rows)
            for i, (req, n) in enumerate(rows):
                req.computed += n
                if req.computed < len(req.tokens):  # a prefill chunk short of the end samples nothing
                    continue
                outs.append(self._append(req, int(tok[i]), float(logp[i]), tops[i]))
        self._stats["steps"] += 1
        return outs

    def _catch_up(self, reqs) -> None:
        """Feed the draft the tokens it missed while its requests took plain decode steps (speculation
        was off for their batch), so its pages hold every computed token again: draft-only prefill
        calls of the prefill shapes (the draft's half of them is compiled by ``precompile``)."""
        while reqs:
            rows, (_, b, t, p) = self.scheduler.catch_up_plan(reqs)
            self.draft.follow(*batch_arrays([(r.tokens[at:at + n], at, r.pages) for r, at, n in rows],
                                            self.page_size, b, t, p))
            self._stats["calls"] += 1
            self._stats["spec_catch_up_tokens"] += sum(n for *_, n in rows)
            self.scheduler.caught_up(rows)
            reqs = [r for r in reqs if r.id in self.scheduler.draft_at]

    def _accept(self, rows, n, emitted, logp) -> list[RequestOutput]:
        """Each row's accepted drafts and next token, one output per token, up to its finish."""
        outs = []
        k = self.draft.k
        m_rows = [int(m) for m in n[:len(rows)]]
        self._stats["spec_rounds"] += 1
        if self.spec_policy is not None:  # a row that accepted m < k proposals stopped at a rejection
            self.spec_policy.record_round(sum(m_rows), sum(m < k for m in m_rows))
        for i, (req, _) in enumerate(rows):
            m = m_rows[i]
            self._stats["spec_proposed"] += k
            self._stats["spec_accepted"] += m
            req.computed += m + 1  # the pending token and the m accepted drafts are in both models' pages
            for j in range(m + 1):
                outs.append(self._append(req, int(emitted[i, j]), float(logp[i, j])))
                if outs[-1].finished:
                    break
        return outs

    def _append(self, req: Request, tok: int, logp: float, top=()) -> RequestOutput:
        req.output.append(tok)
        req.logprobs.append(logp)
        p, seen = req.params, req.counts.get(tok, 0)
        req.counts[tok] = seen + 1
        if p.presence_penalty or p.frequency_penalty:  # the next step's logits[tok] pay for this one
            req.adjust[tok] = req.adjust.get(tok, 0.0) - p.frequency_penalty - (p.presence_penalty if not seen else 0.0)
        self._stats["generated_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        try:
            req.finish_reason = self._finish_reason(req, tok)
        except Exception as e:  # noqa: BLE001 - one request's failure (a decode callable, a stop check) ends it alone
            req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
        if req.finish_reason is not None:
            self.scheduler.finish(req)
            self._stops.pop(req.id, None)
        return RequestOutput(req.id, [tok], [logp], req.finish_reason is not None, req.finish_reason, req.error,
                             [list(top)])

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        """req's finish after its new token ``tok`` (its StopChecker's decision), or None."""
        stops = self._stops.get(req.id)
        if stops is None:
            p, detok = req.params, None
            if p.stop:
                if self.decode is None:
                    raise ValueError("stop strings need the engine's decode function (a tokenizer)")
                detok = Detokenizer(types.SimpleNamespace(decode=self.decode), p.stop)
            stops = self._stops[req.id] = StopChecker(p, eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                                                      detok=detok)
        return stops.add(tok, len(req.output), len(req.tokens))[1]


__all__ = ["Engine", "SPEC_MAX_BATCH", "paged_forward"]
