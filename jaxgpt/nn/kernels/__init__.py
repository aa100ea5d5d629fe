"""Attention kernels behind ``Execution.attention_impl`` and the one entry every caller uses.

``attend`` is the only way into a kernel: the Attention module calls it for training forwards,
for prefill and for every decode step, whatever the KV cache's layout. The kernels compute the
same numbers (1e-5 in float32, forward and gradients); they differ in memory and speed:

    'xla'      xla.py       einsum softmax; (Tq, Tk) scores; attention weights and dropout
    'jax'      jax_sdpa.py  jax.nn.dot_product_attention (XLA implementation)
    'cudnn'    jax_sdpa.py  the same with cuDNN flash attention (GPU, bf16/fp16; else XLA + one warning)
    'blocked'  blocked.py   flash-style online softmax, memory linear in T
    'ffi'      causal_ffi.py  a C++ kernel (CPU, float32): causal self-attention without a mask, cache
                            or dropout; other calls (decode, masks) run what 'auto' picks among the rest
    'auto'     one of the above per call, backend and shape (auto_impl): the ModelConfig default;
               on a GPU, cuDNN flash attention for train steps in bf16/fp16, never (T, T) scores

'auto' and 'ffi' run one more C++ kernel for causal calls over a KV cache of up to
CACHE_KERNEL_MAX_TQ queries (decode steps, short prefills; CPU, float32, no mask):
paged_ffi.cached_attention reads the cache in place and only up to each query's position, where
the einsum reads and masks every slot (docs/performance.md).

In a program lowered for a TPU, 'auto' and 'ffi' run JAX's Pallas TPU flash attention
(tpu_flash.py) on self-attention over the call's own keys (causal or not, GQA, segment ids) with
T a multiple of 128; the rule is tpu_flash.unsupported, and every other call runs the rest of 'auto'.

The C++ kernels are CPU kernels: 'auto' stages each beside the portable kernel it would run
otherwise, and the platform the program is lowered for picks one (policy.py); an explicit 'ffi'
fails to lower for another platform.

Every mask a kernel applies comes from masks.py, sliding windows included: every kernel takes
``window`` (the C++ training kernel a static one only). The kernels are looked up on their modules at
call time (``xla.scaled_dot_product_attention``, ...), so a test can count which one ran.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxgpt.config import ATTENTION_IMPLS
from jaxgpt.config.model import SOFTCAP_REFUSED
from jaxgpt.core import validate
from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels import blocked, causal_ffi, jax_sdpa, masks, paged, paged_dispatch, paged_ffi, policy, tpu_flash, xla
from jaxgpt.nn.kernels.blocked import blocked_attention
from jaxgpt.nn.kernels.jax_sdpa import cudnn_unsupported, jax_attention, warn_once
from jaxgpt.nn.kernels.masks import causal_mask, grouped_mask, keys_before, segment_mask
from jaxgpt.nn.kernels.xla import KV_LAYOUTS, kv_shape, scaled_dot_product_attention

__all__ = ["ATTENTION_IMPLS", "KV_LAYOUTS", "attend", "auto_impl", "blocked_attention", "causal_mask", "cudnn_unsupported",
           "ffi_unsupported", "grouped_mask", "jax_attention", "keys_before", "scaled_dot_product_attention",
           "segment_mask", "warn_once"]


FFI_MAX_LEN = 4096
CACHE_KERNEL_MAX_TQ = 16  # it loops over the queries one by one: longer prefills run the kernels above
FFI_AUTO_MAX_LEN = 1024  # 'auto' runs 'ffi' up to this length (it holds T x T scores per thread)


def auto_impl(tq: int, tk: int, block: int, dropout_rate: float = 0.0, q=None, plain: bool = False,
              softcap: float | None = None) -> str:
    """The kernel attention_impl='auto' runs where 'ffi' cannot (attend runs 'ffi' first: causal
    float32 self-attention without a mask, cache or dropout, T <= FFI_AUTO_MAX_LEN, on the CPU).
    By measurement (docs/performance.md):

    - GPU: 'cudnn' (flash attention, memory linear in T) for ``plain`` calls (self-attention over the
      call's own keys: no mask, no KV cache, causal from offset 0) on queries ``q`` cuDNN takes
      (bfloat16/float16, head_dim a multiple of 8 up to 256; a call it still rejects runs 'blocked').
      'xla' materialises (B, H, T, T) float32 scores per layer.
    - Every backend, for the rest: 'blocked' for training and prefill over more than one key block
      (memory linear in T; on the CPU it skips the masked causal blocks), else 'xla' (decode steps,
      short sequences: equal or faster). In a
      program lowered for a TPU, attend runs JAX's Pallas flash attention instead on the calls
      tpu_flash.unsupported accepts (train steps and prefill, T a multiple of 128; no TPU measured).
    - Always 'xla' with attention dropout, the only kernel that has it.
    - Never 'cudnn' with ``softcap`` (score soft-capping, Gemma 2): only 'xla' and 'blocked' have it.
    """
    if dropout_rate > 0.0:
        return "xla"
    if plain and softcap is None and tq > 1 and q is not None and jax.default_backend() == "gpu" and \
            cudnn_unsupported(q) is None:
        return "cudnn"
    return "blocked" if tq > 1 and tk > block else "xla"


def _plain(q, mask, is_causal, q_offset, kv_layout, tk, window=None) -> bool:
    """Self-attention over the call's own keys without a mask (a train step's attention); a sliding
    window only as a static int (cuDNN's local window)."""
    static_zero = isinstance(q_offset, int) and q_offset == 0
    return kv_layout == "tokens" and mask is None and (window is None or isinstance(window, int)) and \
        (not is_causal or (static_zero and q.shape[1] == tk))


@precision.float32_full  # alone: full-precision float32 matmuls off the CPU; in a model: the model's setting
def attend(q, k, v, *, impl="auto", block=128, mask=None, is_causal=False, q_offset=0, scale=None,
           return_weights=False, kv_layout="tokens", pages=None, dropout_rate=0.0, dropout_rng=None,
           segment_ids=None, softcap=None, window=None):
    """Attention of q (B, Tq, H, D) over k, v in ``kv_layout`` (KV_LAYOUTS), by the kernel ``impl``.
    kv_layout 'pages': k, v are a paged cache's pools (num_pages, H_kv, page_size, D) and ``pages``
    its paged.Pages (page_table (B, P), q_pos (B, Tq), int8 scales, kernel); the platform's kernel
    reads them in place (paged_dispatch.py: C++ on the CPU, Pallas on CUDA and TPU, causal by
    position), or, for the weights, they are gathered.

    The contract of xla.scaled_dot_product_attention on every kernel: bool masks (True = attend)
    broadcastable to (B, H, Tq, Tk), validated here; causal with a possibly traced ``q_offset``;
    zeros for a query row with no visible key. ``block``: the 'blocked' kernel's block length.
    ``return_weights`` runs 'xla', the only kernel that builds the weights. Attention dropout
    exists on 'xla' only; any other kernel refuses it (ModelConfig refuses the pair up front).
    ``segment_ids`` (B, T) int: packed documents in self-attention over the call's own keys (no
    KV cache); a query sees only keys of its own id. 'blocked' and 'ffi' compare the ids block by
    block; 'xla', 'jax' and 'cudnn' take them as a (B, 1, T, T) mask; 'auto' never picks cuDNN for
    them (memory-linear 'blocked' on a GPU).
    ``softcap``: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2). 'xla' and
    'blocked' have it; 'auto' runs one of them (never a C++ kernel or cuDNN); an explicit 'jax',
    'cudnn' or 'ffi' is refused (SOFTCAP_REFUSED), never run without the cap.
    ``window`` W (int, or a traced int32 scalar: a scanned layer's; masks.NO_WINDOW where it does not
    slide): sliding-window causal attention, query position p over keys p - W < j <= p. Every kernel
    applies it; the C++ training kernel only a static int ('ffi' refuses a traced one, 'auto' runs a
    portable kernel for it).
    Returns out (B, Tq, H, D), and weights (B, H, Tq, Tk) float32 if ``return_weights``.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not one of {ATTENTION_IMPLS}")
    if softcap is not None and impl in SOFTCAP_REFUSED:
        raise ValueError(f"attention_impl={impl!r} has no attention soft-capping (softcap={softcap}); "
                         "use 'auto', 'xla' or 'blocked'")
    kw = dict(impl=impl, block=block, scale=scale, softcap=softcap)
    if kv_layout == "pages":
        if mask is not None or dropout_rate > 0.0 or segment_ids is not None:
            raise ValueError("kv_layout='pages' is causal by the query positions: no mask, segment ids or dropout")
        return _attend_pages(q, k, v, paged.Pages(*pages), return_weights=return_weights, q_offset=q_offset,
                             window=window, **kw)
    if window is not None and not is_causal:
        raise ValueError("a sliding window narrows causal attention: pass is_causal=True (or window=None)")
    b, tq, h, _ = q.shape
    h_kv, tk = kv_shape(k, kv_layout, b)
    if mask is not None:
        mask = jnp.asarray(mask)
        validate.check_mask(mask.shape, mask.dtype, (b, h, tq, tk))
    if segment_ids is not None:
        if kv_layout != "tokens" or tk != tq or not (isinstance(q_offset, int) and q_offset == 0):
            raise ValueError("segment_ids pack documents into a forward over its own keys: no KV cache "
                             f"(got kv_layout={kv_layout!r}, {tq} queries over {tk} keys)")
        segment_ids = jnp.asarray(segment_ids)
        validate.check_segment_ids(segment_ids.shape, segment_ids.dtype, (b, tq))
    call = _Call(mask=mask, is_causal=is_causal, q_offset=q_offset, return_weights=return_weights,
                 kv_layout=kv_layout, dropout_rate=dropout_rate, dropout_rng=dropout_rng, segment_ids=segment_ids,
                 window=window, b=b, tq=tq, h_kv=h_kv, tk=tk, **kw)
    return call.dispatch(q, k, v)


def _attend_pages(q, k_pool, v_pool, pages, *, impl, block, scale, softcap, window, return_weights, q_offset):
    """attend over a paged cache's pools: each platform's in-place kernel, or the pages gathered."""
    gathered = functools.partial(_gathered, pages=pages, impl=impl, block=block, scale=scale, softcap=softcap,
                                 window=window)
    if not return_weights and softcap is None:
        return paged_dispatch.attend_pages(q, k_pool, v_pool, pages, scale=scale, window=window, gathered=gathered)
    if not return_weights:  # no in-place kernel has soft-capping: the pages gathered (the engine's 'gather')
        return gathered(q, k_pool, v_pool)
    k, v, mask = _gather(k_pool, v_pool, pages, q.dtype, window)  # the weights: the xla kernel over the gathered pages
    return attend(q, k, v, impl=impl, block=block, mask=mask, q_offset=q_offset, scale=scale, return_weights=True,
                  kv_layout="rows", softcap=softcap)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One attend call's settings, checked: which kernel runs it (``dispatch``) and how (``run``)."""

    impl: str
    block: int
    scale: float | None
    softcap: float | None
    mask: object
    is_causal: bool
    q_offset: object
    return_weights: bool
    kv_layout: str
    dropout_rate: float
    dropout_rng: object
    segment_ids: object
    window: object
    b: int
    tq: int
    h_kv: int
    tk: int

    def dispatch(self, q, k, v):
        """The C++ cache kernel, the C++ training kernel, or the kernel ``impl`` names ('auto': ``portable``)."""
        impl, return_weights = self.impl, self.return_weights
        if impl in ("auto", "ffi") and not return_weights and self.dropout_rate == 0.0 and self.softcap is None and \
                cache_kernel_unsupported(q, k, self.mask, self.is_causal, self.kv_layout) is None:  # k, v as stored
            return policy.on_cpu(lambda q, k, v: paged_ffi.cached_attention(q, k, v, self.q_offset, scale=self.scale,
                                                                            window=self.window), self.portable, q, k, v)
        why = ffi_unsupported(q, self.mask, self.is_causal, self.q_offset, self.kv_layout, self.tk)
        static_window = self.window is None or (isinstance(self.window, int) and not isinstance(self.window, bool))
        ffi = why is None and static_window and self.softcap is None
        if impl == "ffi":  # a cache, a mask, bf16: 'auto' without it
            if why is None and not static_window:
                raise ValueError("attention_impl='ffi' (the C++ causal training kernel) takes a static sliding window, "
                                 "not a traced one (scanned layers mixing sliding and global ones); use "
                                 "attention_impl='auto' or scan_layers=False")
            if not ffi:
                return self.portable(q, k, v)
            return policy.cpu_kernel(not return_weights, True, functools.partial(self.run, "ffi", False),
                                     functools.partial(self.run, "xla", False), q, k, v, what="attention_impl='ffi'")
        if impl == "auto":
            use = ffi and self.dropout_rate == 0.0 and not return_weights and self.tq <= FFI_AUTO_MAX_LEN
            return policy.cpu_kernel(use, False, functools.partial(self.run, "ffi", True), self.portable, q, k, v)
        if impl == "cudnn" and not return_weights and cudnn_unsupported(q) is None:  # jax.nn's XLA path off CUDA
            return policy.on_cuda(functools.partial(self.run, "cudnn", False), functools.partial(self.run, "jax", False),
                                  q, k, v)
        return self.run(impl, False, q, k, v)

    def portable(self, q, k, v):
        """Where no C++ kernel runs: Pallas flash in a TPU program, cuDNN in a CUDA one, else 'auto's pick."""
        flash = self.softcap is None and self.window is None and tpu_flash.unsupported(
            q, k, mask=self.mask, is_causal=self.is_causal, q_offset=self.q_offset, kv_layout=self.kv_layout,
            scale=self.scale, dropout_rate=self.dropout_rate, return_weights=self.return_weights) is None
        if flash:
            return policy.on_tpu(lambda q, k, v: tpu_flash.flash_attention(
                q, k, v, is_causal=self.is_causal, scale=self.scale, segment_ids=self.segment_ids), self.picked, q, k, v)
        return self.picked(q, k, v)

    def picked(self, q, k, v):
        plain = self.segment_ids is None and _plain(q, self.mask, self.is_causal, self.q_offset, self.kv_layout, self.tk,
                                                    self.window)
        pick = auto_impl(self.tq, self.tk, self.block, self.dropout_rate, q, plain, self.softcap)
        if pick != "cudnn":
            return self.run(pick, True, q, k, v)
        return policy.on_cuda(functools.partial(self.run, "cudnn", True),
                              functools.partial(self.run, auto_impl(self.tq, self.tk, self.block, self.dropout_rate), True),
                              q, k, v)

    def run(self, impl: str, picked: bool, q, k, v):
        """The kernel ``impl`` on this call; ``picked``: chosen by 'auto' (a rejected cuDNN call runs 'blocked')."""
        fallback = picked and self.tq > 1 and self.tk > self.block  # else a rejected 'cudnn' call runs jax.nn's 'xla'
        if self.dropout_rate > 0.0 and impl != "xla":
            raise ValueError(f"attention_impl={impl!r} has no attention dropout (dropout_rate={self.dropout_rate}); "
                             f"set attn_dropout=0.0 or attention_impl='xla'")
        m, seg, layout = self.mask, self.segment_ids, self.kv_layout
        if seg is not None and (self.return_weights or impl not in ("ffi", "blocked")):  # the ids as a (T, T) mask
            m, seg = masks.both(m, segment_mask(seg, seg)), None
        kw = dict(mask=m, is_causal=self.is_causal, q_offset=self.q_offset, scale=self.scale, window=self.window)
        if self.softcap is not None:  # only 'xla' and 'blocked' take it (auto_impl and attend's check)
            kw["softcap"] = self.softcap
        if impl == "xla" or self.return_weights:
            return xla.scaled_dot_product_attention(q, k, v, return_weights=self.return_weights, kv_layout=layout,
                                                    dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng, **kw)
        if layout == "rows":  # (B * H_kv, Tk, D) -> (B, H_kv, Tk, D): splits the leading dim, no copy
            k, v, layout = k.reshape(self.b, self.h_kv, self.tk, -1), v.reshape(self.b, self.h_kv, self.tk, -1), "heads"
        if impl == "ffi":  # a static window only (dispatch)
            return causal_ffi.causal_attention(q, k, v, scale=self.scale, segment_ids=seg, window=self.window)
        if impl == "blocked":
            return blocked.blocked_attention(q, k, v, block=self.block, kv_layout=layout, segment_ids=seg, **kw)
        return jax_sdpa.jax_attention(q, k, v, kv_layout=layout, implementation="cudnn" if impl == "cudnn" else None,
                                      fallback=functools.partial(blocked.blocked_attention, block=self.block)
                                      if fallback else None, **kw)


def _gather(k_pool, v_pool, pages, dtype, window=None):
    return paged.gather(k_pool, v_pool, pages.page_table, pages.q_pos, pages.k_scale, pages.v_scale, dtype,
                        window=window)


def _gathered(q, k_pool, v_pool, *, pages, window=None, **kw):
    """Attention over a paged cache's pages gathered into kv_layout 'rows' (kernels/paged.py), computed
    in q's dtype as the in-place kernels are (bfloat16 pools under float32 queries: an exact upcast)."""
    k, v, mask = _gather(k_pool, v_pool, pages, q.dtype, window)
    return attend(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, kv_layout="rows", **kw)


def cache_kernel_unsupported(q, k, mask, is_causal, kv_layout) -> str | None:
    """Why a KV-cache call (prefill or decode step) cannot run the C++ cache kernel
    (paged_ffi.cached_attention), which reads each row's keys only up to its query's position (None: it can)."""
    if kv_layout == "tokens":
        return "it reads a KV cache (kv_layout 'rows' or 'heads')"
    if not is_causal or mask is not None:
        return "it computes causal attention without a mask"
    if q.shape[1] > CACHE_KERNEL_MAX_TQ:
        return f"it loops over queries one by one: at most {CACHE_KERNEL_MAX_TQ} a call (got {q.shape[1]})"
    if q.dtype != jnp.float32 or k.dtype != jnp.float32:
        return f"it computes in float32 (got {q.dtype} queries, {k.dtype} keys)"
    if not paged_ffi.available():
        return f"the kernel is unavailable on this {jax.default_backend()} backend (see the warning)"
    return None


def ffi_unsupported(q, mask, is_causal, q_offset, kv_layout, tk) -> str | None:
    """Why the 'ffi' kernel cannot run this call (None: it can)."""
    if not is_causal or mask is not None:
        return "it computes causal attention without a mask"
    if not (isinstance(q_offset, int) and q_offset == 0) or q.shape[1] != tk or kv_layout != "tokens":
        return "it computes self-attention over the call's own keys (no KV cache)"
    if q.dtype != jnp.float32:
        return f"it computes in float32 (got {q.dtype})"
    if q.shape[1] > FFI_MAX_LEN:
        return f"it holds T x T scores per thread, so T must be <= {FFI_MAX_LEN} (got {q.shape[1]}); 'blocked' is O(T)"
    if not causal_ffi.available():
        return f"the kernel is unavailable on this {jax.default_backend()} backend (see the warning)"
    return None
