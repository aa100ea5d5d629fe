"""attention_impl='jax' and 'cudnn': ``jax.nn.dot_product_attention`` (implementation None or
'cudnn') under jaxgpt's contract: bool masks, a traced causal offset, zeros for rows with no
visible key (jax.nn alone returns the mean of v there)."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels.masks import as_4d, both, causal_mask

_HALF = (jnp.bfloat16, jnp.float16)
# What jax.nn's cuDNN path raises while tracing a call it cannot run: NotImplementedError for
# shapes, dtypes and GPU generations; ValueError for layouts and masks it rejects; RuntimeError
# when no cuDNN is found. Errors of the call itself come back from the 'xla' retry.
CUDNN_FAILURES = (NotImplementedError, ValueError, RuntimeError)


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """One warning per distinct message per process (a jitted model traces many times)."""
    warnings.warn(message, stacklevel=3)


def _static_zero(x) -> bool:
    return isinstance(x, int) and x == 0


def cudnn_unsupported(q) -> str | None:
    """Why cuDNN flash attention cannot run this call, or None when it can (as far as we know)."""
    if jax.default_backend() != "gpu":
        return f"no GPU (JAX backend is {jax.default_backend()!r})"
    if q.dtype not in _HALF:
        return f"dtype {q.dtype} (cuDNN flash attention needs bfloat16 or float16; set dtype='bfloat16')"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"head_dim {d} (cuDNN needs a multiple of 8, at most 256)"
    return None


@precision.float32_full
def jax_attention(q, k, v, *, mask=None, is_causal=False, q_offset=0, scale=None, kv_layout="tokens",
                  implementation=None, fallback=None, window=None):
    """``jax.nn.dot_product_attention``; k, v in kv_layout 'tokens' or 'heads'. ``implementation``:
    None or 'cudnn'. A 'cudnn' call cuDNN cannot run falls back, with one warning naming why, to
    ``fallback`` (a kernel with this function's contract: attention_impl='auto' passes the
    memory-linear 'blocked') or else to jax.nn's 'xla' implementation. A sliding ``window`` W: jax.nn's
    ``local_window_size=(W - 1, 0)`` where W is a static int on the causal flag, else in the mask."""
    if implementation == "cudnn" and fallback is not None:
        why = cudnn_unsupported(q)
        if why is None:
            try:
                return _jax_attention(q, k, v, mask, is_causal, q_offset, scale, kv_layout, "cudnn", window,
                                      strict=True)
            except CUDNN_FAILURES as e:
                why = f"cuDNN rejected the call ({type(e).__name__}: {e})"
        warn_once(f"attention_impl='auto' runs 'blocked' instead of cuDNN flash attention: {why}")
        return fallback(q, k, v, mask=mask, is_causal=is_causal, q_offset=q_offset, scale=scale, kv_layout=kv_layout,
                        window=window)
    return _jax_attention(q, k, v, mask, is_causal, q_offset, scale, kv_layout, implementation, window)


def _jax_attention(q, k, v, mask, is_causal, q_offset, scale, kv_layout, implementation, window, strict=False):
    if kv_layout == "heads":  # jax.nn wants (B, Tk, H_kv, D)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    tq, tk = q.shape[1], k.shape[1]
    m = None if mask is None else as_4d(mask)  # (B|1, H|1, Tq|1, Tk|1)
    # jax.nn's is_causal is tril(Tq, Tk) == our rule at offset 0; any other offset needs a mask.
    flag = is_causal and _static_zero(q_offset) and (tq == tk or implementation != "cudnn") and \
        (window is None or isinstance(window, int))
    local = None if window is None or not flag else (window - 1, 0)  # keys i - (W - 1) .. i: transformers' rule
    if is_causal and not flag:
        m = both(m, causal_mask(tq, tk, q_offset, window=window)[None, None])
    if implementation == "cudnn":
        why = cudnn_unsupported(q)
        if why is not None:
            warn_once(f"attention_impl='cudnn' falls back to the XLA implementation: {why}")
            implementation = "xla"
    call = functools.partial(jax.nn.dot_product_attention, q, k, v, mask=m, scale=scale, is_causal=flag,
                             local_window_size=local)
    try:
        out = call(implementation=implementation)
    except CUDNN_FAILURES as e:
        if implementation != "cudnn" or strict:
            raise
        warn_once(f"attention_impl='cudnn' falls back to the XLA implementation: cuDNN rejected the call "
                  f"({type(e).__name__}: {e})")
        out = call(implementation="xla")
    if mask is not None:  # a row with no visible key: zeros, not jax.nn's mean of v
        seen = both(m, causal_mask(tq, tk, window=window)) if flag else m  # the causal part jax.nn applied
        any_key = seen.any(-1).transpose(0, 2, 1)[..., None]  # (B|1, Tq|1, H|1, 1)
        out = jnp.where(any_key, out, jnp.zeros((), out.dtype))
    return out
