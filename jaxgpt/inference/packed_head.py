"""The engine's vocabulary projection, packed for the CPU kernel (kernels/panel_ffi.py).

A decode step projects a few rows onto the whole vocabulary; on the CPU that GEMM is the largest
part of a step, and the panel kernel runs it with the greedy argmax in one pass, faster than XLA's
dot and the engine's argmax (docs/performance.md, "Serving engine: the figures behind its
constants"). The engine packs the head's weight once (``pack_head``;
the model's (d, V) lm_head kernel, or the tied (V, d) embedding), has the model return its final
hidden states (``DecoderLM(hidden=True)``) and projects them here (``project``): the model's head
with another summation order, about 1e-6 from it.

``head_kernel``: 'panel' (the kernel; an error where it cannot run), 'xla' (the model's own head),
'auto' (the kernel where it can run and measured faster on this machine: panel_ffi.wins).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgpt.inference.sampling import argmax
from jaxgpt.models.decoder import final_logits
from jaxgpt.nn.kernels import panel_ffi, policy

HEAD_KERNELS = ("auto", "panel", "xla")


def unsupported(config) -> str | None:
    """Why the panel head cannot run for this model here, or None."""
    if config.dtype != "float32" or config.param_dtype != "float32":
        return f"the panel kernel is float32; this model computes in {config.dtype} ({config.param_dtype} weights)"
    if jax.default_backend() != "cpu":
        return f"the panel kernel runs on the CPU; the backend is {jax.default_backend()}"
    if not panel_ffi.available():
        return "the CPU panel-matmul kernel is unavailable here (see the warning above)"
    return None


def resolve_head_kernel(choice: str, config) -> str:
    """'panel' or 'xla' for ``choice`` (HEAD_KERNELS) and this model."""
    if choice not in HEAD_KERNELS:
        raise ValueError(f"head_kernel={choice!r} is not one of {HEAD_KERNELS}")
    if choice == "xla":
        return "xla"
    why = unsupported(config)
    if choice == "panel":
        if why:
            raise ValueError(f"head_kernel='panel': {why}")
        return "panel"
    return "panel" if why is None and panel_ffi.wins() else "xla"


def pack_head(config, params) -> dict:
    """{'panels': the head's weight packed (ceil(V / 64), d, 64), 'bias': (V,) or None} from the
    model's params (lm_head, or the tied token embedding)."""
    if config.tie_embeddings:
        w = jnp.asarray(params["tok_embed"]["embedding"]).T  # (d, V)
    else:
        w = params["lm_head"]["kernel"]  # (d, V)
    bias = params["lm_head"]["bias"] if config.lm_head_bias else None
    return {"panels": panel_ffi.pack(w), "bias": None if bias is None else jnp.asarray(bias, jnp.float32)}


def project(config, head: dict, h):
    """Final hidden states h (..., d) -> (float32 logits (..., V) as the model's head and
    ``mask_padded_vocab`` give them, their argmax (...) int32 as ``sampling.argmax`` gives it)."""
    d, lead = h.shape[-1], h.shape[:-1]
    n, valid = config.vocab_size, config.token_vocab
    kernel = lambda x, panels, bias: panel_ffi.panel_matmul(x, panels, n, bias, valid)
    logits, top = policy.on_cpu(kernel, lambda x, panels, bias: _unpacked(x, panels, n, bias, valid),
                                h.reshape(-1, d).astype(jnp.float32), head["panels"], head["bias"])
    if config.logit_softcap is not None:  # the model's final_logits: capped, padded ids re-masked, argmax again
        # (tanh is monotone, but two logits it rounds to one capped value tie: argmax takes the first, as the model's)
        logits = final_logits(config, logits)
        top = argmax(logits)
    return logits.reshape(*lead, n), top.reshape(lead)


def _unpacked(x, panels, n: int, bias, valid: int | None):
    """panel_ffi.panel_matmul's result in jax.numpy (a program lowered for another platform than the CPU)."""
    w = panels.transpose(1, 0, 2).reshape(x.shape[1], -1)[:, :n]  # (d, n)
    logits = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)  # (M, n) float32
    logits = logits if bias is None else logits + bias
    if valid is not None and valid < n:
        logits = jnp.where(jnp.arange(n) >= valid, jnp.finfo(jnp.float32).min, logits)
    return logits, argmax(logits)


__all__ = ["HEAD_KERNELS", "pack_head", "project", "resolve_head_kernel", "unsupported"]
