"""Continuous batching over a paged KV cache (vLLM's scheduler, small).

Each ``step()``: admit waiting requests while pages and ``max_seqs`` allow; give every running
request that is decoding one token of the ``max_tokens_per_step`` budget, and the rest of it to
prefill chunks (chunked prefill, the chunk length chosen by ``paged_cache.plan_prefill`` to waste
few padded slots); allocate pages, preempting the latest admitted request when
they run out (its pages are freed and it is recomputed from its prompt and outputs later);
run one jitted call for all decode rows and one for the prefill chunks; sample per request;
finish on EOS, stop ids, stop strings, ``max_tokens`` or the context window, freeing pages.
With prefix caching (on by default) admission first hands a request the cached full pages of its
tokens' prefix, and freed full pages stay cached until evicted (prefix_cache.py). The bookkeeping
(requests, pages, admission, preemption, each step's plan of rows) is ``scheduler.Scheduler``'s,
which ``Engine`` extends with the programs that run the plan.

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
from functools import partial

import jax
import numpy as np

from jaxgpt.inference import speculative
from jaxgpt.inference.detokenize import Detokenizer
from jaxgpt.inference.packed_head import pack_head, resolve_head_kernel
from jaxgpt.inference.paged_cache import (MIN_CHUNK, MIN_PAGES, MIN_ROWS, batch_arrays, bucket, init_pools,
                                          resolve_paged_kernel)
from jaxgpt.inference.paged_model import paged_apply
from jaxgpt.inference.requests import Request, RequestOutput
from jaxgpt.inference.sampling import SamplingParams, batch_settings, sample_requests
from jaxgpt.inference.scheduler import Scheduler
from jaxgpt.models.decoder import unstack_layers


# 'auto': speculate where measured acceptance and call times say it pays (spec_policy.py). The crossover
# batch size moves with the acceptance rate (docs/serving.md: a pair agreeing 30% of the time loses at 8
# in flight on a 2-core CPU, one agreeing 97% wins 1.97x there), so no fixed int is right for every pair.
SPEC_MAX_BATCH = "auto"


@partial(jax.jit, static_argnames=("config", "kernel"), donate_argnums=(1,))
def paged_forward(params, pools, tokens, q_pos, slots, page_table, last, head=None, *, config, kernel="gather"):
    """One engine call: tokens (B, T) at positions q_pos (-1 = padding) -> (pools, greedy next
    tokens (B,), last-token logits (B, V)). The pools are donated: updated in place. ``head``: the
    packed vocabulary projection (packed_head.py) or None (the model's own).

    Sampling is a second program (``sampling.sample``), run only when a row samples, wants
    logprobs or has a bias or penalties: its sort doubled the compile time of every (B, T, P)
    shape, and it depends on B alone.
    """
    logits, pools, top = paged_apply(config, params, pools, tokens, q_pos, slots, page_table, kernel, logits_at=last,
                                     head=head)
    return pools, top[:, 0], logits[:, 0]  # (B,), (B, V)


class Engine(Scheduler):
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
    """

    def __init__(self, config, params, *, max_seqs: int = 32, page_size: int = 16, num_pages: int | None = None,
                 max_tokens_per_step: int = 512, kv_dtype: str = "auto", paged_kernel: str = "auto", eos_ids=(),
                 decode=None, draft=None, num_speculative_tokens: int = 4, max_model_len: int | None = None,
                 spec_max_batch: int | str = SPEC_MAX_BATCH, enable_prefix_caching: bool = True,
                 head_kernel: str = "auto"):
        if config.residual != "standard":
            raise ValueError(f"the engine needs a KV cache; residual={config.residual!r} models have none")
        for name, val in (("max_seqs", max_seqs), ("page_size", page_size), ("max_tokens_per_step",
                                                                             max_tokens_per_step)):
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        self.config, (_, params) = config, unstack_layers(config, params)  # paged_apply runs separate layers
        self.head_kernel = resolve_head_kernel(head_kernel, self.config)
        self.params, self.head = self._device_params(self.config, params, self.head_kernel)
        max_model_len = config.max_len if max_model_len is None else max_model_len
        if not 2 <= max_model_len <= config.max_len:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, {config.max_len}]: the model's "
                             f"context is {config.max_len} tokens, and a request needs a prompt token and an output")
        pages_per_seq = -(-max_model_len // page_size)
        window = self._bounded_window(draft)
        if window is not None:  # a request holds its window's pages and one step's chunk at most
            pages_per_seq = min(pages_per_seq, -(-(window - 1 + max_tokens_per_step) // page_size) + 1)
        if num_pages is None:
            num_pages = max_seqs * pages_per_seq + 1
        if num_pages - 1 < pages_per_seq:
            raise ValueError(f"num_pages={num_pages} cannot hold one full context ({max_model_len} tokens = "
                             f"{pages_per_seq} pages of {page_size}, plus the scratch page"
                             f"{'; a sliding window: its keys and one step' if window is not None else ''})")
        if not (spec_max_batch == "auto" or type(spec_max_batch) is int and spec_max_batch >= 1):  # not a bool
            raise ValueError(f"spec_max_batch must be 'auto' or an int >= 1, got {spec_max_batch!r}")
        # token_vocab: a padded table's extra rows are no tokens
        super().__init__(vocab=self.config.token_vocab, max_model_len=max_model_len, max_seqs=max_seqs,
                         page_size=page_size, num_pages=num_pages, budget=max_tokens_per_step,
                         prefix_caching=enable_prefix_caching, k=None if draft is None else num_speculative_tokens,
                         spec_max_batch=spec_max_batch, window=window)
        self.kv_dtype = kv_dtype
        self.pools = init_pools(self.config, num_pages, page_size, kv_dtype)
        self.paged_kernel = resolve_paged_kernel(paged_kernel, self.config.dtype, self.pools[0][0].dtype,
                                                 self.config.head_dim, page_size,
                                                 self.config.attn_softcap)
        self.eos_ids = set(int(i) for i in eos_ids)
        self.decode = decode
        self._detoks: dict[str, Detokenizer] = {}  # per request with stop strings
        self.shapes: set[tuple] = set()  # every (kind, B, T, P) shape run: the compilations
        self.draft = None if draft is None else self._init_draft(*draft, kv_dtype=kv_dtype, paged_kernel=paged_kernel,
                                                                 head_kernel=head_kernel,
                                                                 num_pages=num_pages)

    def _bounded_window(self, draft) -> int | None:
        """The window past which a request's pages are released (Scheduler._drop_outside_window): the
        model's, where every layer slides and no draft model (whose pools share the page ids) reads them."""
        cfg = self.config
        return cfg.sliding_window if cfg.window_layers is None and draft is None else None

    def _init_draft(self, config, params, *, kv_dtype, paged_kernel, head_kernel, num_pages):
        if config.vocab_size != self.config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({config.vocab_size}) differs from the target's "
                             f"({self.config.vocab_size}); speculative decoding needs the same one")
        if config.residual != "standard":
            raise ValueError(f"the draft needs a KV cache; residual={config.residual!r} models have none")
        if config.max_len < self.max_model_len:  # it prefills every prompt the target takes
            raise ValueError(f"the draft's context ({config.max_len}) is shorter than the target's "
                             f"max_model_len ({self.max_model_len})")
        k = self.k
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if k + 1 > self.budget:
            raise ValueError(f"a speculative row takes num_speculative_tokens + 1 = {k + 1} tokens of "
                             f"max_tokens_per_step={self.budget}; raise it or lower num_speculative_tokens")
        _, params = unstack_layers(config, params)
        pools = init_pools(config, num_pages, self.page_size, kv_dtype)
        self.stats.update(spec_proposed=0, spec_accepted=0, spec_catch_up_tokens=0, spec_rounds=0, spec_off_steps=0)
        params, head = self._device_params(config, params, resolve_head_kernel(head_kernel, config))
        return dict(config=config, params=params, head=head, pools=pools,
                    kernel=resolve_paged_kernel(paged_kernel, config.dtype, pools[0][0].dtype, config.head_dim,
                                                            self.page_size, config.attn_softcap))

    @staticmethod
    def _device_params(config, params, head_kernel: str):
        """(params, packed head or None) on the device once: host (NumPy) params would be copied into
        every step's call. A packed head replaces an untied lm_head (the same memory as before)."""
        if head_kernel != "panel":
            return jax.device_put(params), None
        head = jax.device_put(pack_head(config, params))
        if not config.tie_embeddings:
            params = {k: v for k, v in params.items() if k != "lm_head"}
        return jax.device_put(params), head

    def abort(self, request_id: str) -> bool:
        """Cancel a request (a client went away): its pages are freed at once."""
        self._detoks.pop(request_id, None)
        return super().abort(request_id)

    @property
    def compilations(self) -> int:
        return len(self.shapes)

    # -- running ------------------------------------------------------------------------------------
    def _shape(self, kind: str, n_rows: int, n_tokens: int, n_pages: int) -> tuple[str, int, int, int]:
        """(kind, B, T, P) of a call: a few padded rows, tokens or pages cost less than a compilation.
        A speculative row is k + 1 tokens, so its rows start at 1: at batch 1, where speculation pays,
        three padding rows would cost three rows of target work."""
        t = {"decode": 1, "spec": n_tokens}.get(kind) or bucket(n_tokens, MIN_CHUNK, self._chunk_hi)  # <= the plan's T
        b = bucket(n_rows, 1 if kind == "spec" else MIN_ROWS, self._rows_hi)
        return kind, b, t, bucket(n_pages, MIN_PAGES, self._pages_hi)

    def buckets(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, B, T, P) shape ``step()`` can run: the programs it may compile."""
        rows = {self._shape("decode", n, 1, 1)[1] for n in range(1, self.max_seqs + 1)}
        pages = {self._shape("decode", 1, 1, n)[3] for n in range(1, self.max_pages_per_seq + 1)}
        tokens = {self._shape("prefill", 1, n, 1)[2] for n in range(1, self._chunk_hi + 1)}
        spec_rows = {self._shape("spec", n, 1, 1)[1] for n in range(1, self.max_seqs + 1)}
        spec = [("spec", b, self.k + 1, p) for b in spec_rows for p in pages] if self.draft is not None else []
        return sorted([("decode", b, 1, p) for b in rows for p in pages] + spec
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
        for b in sorted({b for _, b, _, _ in shapes}):  # the plain sampling variant; the others on first use
            np.asarray(self._sample(np.zeros((b, self.config.vocab_size), np.float32), [], b)[0])
        return len(todo)

    def _sampling(self, rows, b: int):
        return batch_settings([r for r, _ in rows], b)

    def _sample(self, logits, rows, b: int):
        return sample_requests(logits, [r for r, _ in rows], b, self.config.vocab_size)

    def _call(self, kind: str, b: int, t: int, p: int, rows):
        """Run shape (kind, B, T, P) on rows (req, n_tokens) -> (tokens (B,), logprobs (B,)) numpy and
        each row's top logprobs (a list of (id, logprob) pairs)."""
        self.shapes.add((kind, b, t, p))
        if kind == "spec":
            return self._spec_call(b, p, rows)
        arrays = batch_arrays([(r.tokens[r.computed:r.computed + n], r.computed, r.pages) for r, n in rows],
                              self.page_size, b, t, p)
        self.pools, tok, logits = paged_forward(self.params, self.pools, *arrays, self.head, config=self.config,
                                                kernel=self.paged_kernel)
        if kind == "prefill" and self.draft is not None:  # the draft's pages follow the same chunks
            d = self.draft
            d["pools"] = paged_forward(d["params"], d["pools"], *arrays, d["head"], config=d["config"],
                                       kernel=d["kernel"])[0]
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
        d = self.draft
        self.pools, d["pools"], n, emitted, logp = speculative.speculate(
            self.params, self.pools, d["params"], d["pools"], last, pos, table, *self._sampling(rows, b), self.head,
            d["head"], config=self.config, draft_config=d["config"], k=self.k, kernel=self.paged_kernel,
            draft_kernel=d["kernel"])
        return np.asarray(n), np.asarray(emitted), np.asarray(logp)

    def _run(self, kind: str, rows):
        self.stats["calls"] += 1
        shape = self._shape(kind, len(rows), max(n for _, n in rows), max(self._pages_for(r.computed + n) for r, n in rows))
        # the auto rule's samples; a first call's time is its compilation's
        timed = self.spec_policy is not None and kind != "prefill" and shape in self.shapes
        if timed:  # the draft's queued prefill chunk or catch-up is neither mode's cost: a catch-up before every
            jax.block_until_ready(self.draft["pools"])  # re-explored round would keep speculation off (a wait, no copy)
        t0 = time.perf_counter()
        out = self._call(*shape, rows)  # returns host arrays: the time includes the device's work
        if timed:
            self.spec_policy.record_time(kind == "spec", self.spec_bucket(len(rows)), time.perf_counter() - t0)
        return out

    def step(self) -> list[RequestOutput]:
        """One scheduling round; returns what each request produced in it (streaming)."""
        self._admit()
        spec, decode, prefill = self._schedule()
        outs: list[RequestOutput] = []
        if spec:
            self._catch_up([r for r, _ in spec if r.id in self._draft_at])
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
        self.stats["steps"] += 1
        return outs

    def _catch_up(self, reqs) -> None:
        """Feed the draft the tokens it missed while its requests took plain decode steps (speculation
        was off for their batch), so its pages hold every computed token again: draft-only prefill
        calls of the prefill shapes (the draft's half of them is compiled by ``precompile``)."""
        while reqs:
            rows = []
            for req in reqs[:MIN_ROWS]:  # MIN_ROWS rows of _chunk_hi tokens fit a prefill call's slots
                at = self._draft_at[req.id]
                rows.append((req, at, min(req.computed - at, self._chunk_hi)))
            _, b, t, p = self._shape("prefill", len(rows), max(n for *_, n in rows),
                                     max(self._pages_for(at + n) for _, at, n in rows))
            arrays = batch_arrays([(r.tokens[at:at + n], at, r.pages) for r, at, n in rows], self.page_size, b, t, p)
            d = self.draft
            d["pools"] = paged_forward(d["params"], d["pools"], *arrays, d["head"], config=d["config"],
                                       kernel=d["kernel"])[0]
            self.stats["calls"] += 1
            self.stats["spec_catch_up_tokens"] += sum(n for *_, n in rows)
            for req, at, n in rows:
                self._draft_at[req.id] = at + n
                if at + n == req.computed:
                    del self._draft_at[req.id]
            reqs = [r for r in reqs if r.id in self._draft_at]

    def _accept(self, rows, n, emitted, logp) -> list[RequestOutput]:
        """Each row's accepted drafts and next token, one output per token, up to its finish."""
        outs = []
        m_rows = [int(m) for m in n[:len(rows)]]
        self.stats["spec_rounds"] += 1
        if self.spec_policy is not None:  # a row that accepted m < k proposals stopped at a rejection
            self.spec_policy.record_round(sum(m_rows), sum(m < self.k for m in m_rows))
        for i, (req, _) in enumerate(rows):
            m = m_rows[i]
            self.stats["spec_proposed"] += self.k
            self.stats["spec_accepted"] += m
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
        self.stats["generated_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        try:
            req.finish_reason = self._finish_reason(req, tok)
        except Exception as e:  # noqa: BLE001 - one request's failure (a decode callable, a stop check) ends it alone
            req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
        if req.finish_reason is not None:
            self.running.remove(req)
            self._free(req)
            self.requests.pop(req.id, None)
            self._detoks.pop(req.id, None)
        return RequestOutput(req.id, [tok], [logp], req.finish_reason is not None, req.finish_reason, req.error,
                             [list(top)])

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            if self.decode is None:
                raise ValueError("stop strings need the engine's decode function (a tokenizer)")
            if req.id not in self._detoks:
                self._detoks[req.id] = Detokenizer(types.SimpleNamespace(decode=self.decode), p.stop)
            detok = self._detoks[req.id]
            detok.add([tok])  # a window of recent ids, not the whole output again
            if detok.stopped:
                return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
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
