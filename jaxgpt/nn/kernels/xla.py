"""attention_impl='xla': softmax(q k^T * scale) v written as einsums, (Tq, Tk) scores in float32.
The only kernel that returns the attention weights and applies attention dropout."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.core import validate
from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels.masks import both, causal_mask, grouped_mask
from jaxgpt.nn.kernels.softcap import softcap as capped

# How a kernel reads k and v (the queries are always (B, Tq, H, D)):
#   'tokens' (B, Tk, H_kv, D)     as the projections make them
#   'heads'  (B, H_kv, Tk, D)     a KV cache's layer (KVCache layout 'heads', or one layer of 'stacked')
#   'rows'   (B * H_kv, Tk, D)    row b * H_kv + h: the decode cache (KVCache layout 'rows')
KV_LAYOUTS = ("tokens", "heads", "rows")


class KVRead(NamedTuple):
    """What attention reads from a cache after its write: keys and values in ``layout`` (kernels.KV_LAYOUTS,
    or 'pages' with ``pages``), the mask (broadcastable to (B, H, T, S)), causality and the sliding window."""

    k: jax.Array
    v: jax.Array
    layout: str
    mask: jax.Array | None
    is_causal: bool
    window: object = None
    pages: object = None  # kernels.paged.Pages for layout 'pages'


def kv_shape(k, kv_layout: str, batch: int) -> tuple[int, int]:
    """(H_kv, Tk) of keys k in ``kv_layout``."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not one of {KV_LAYOUTS}")
    if kv_layout == "rows":
        if k.shape[0] % batch:
            raise ValueError(f"kv_layout='rows' keys of {k.shape[0]} rows do not split into batch {batch}")
        return k.shape[0] // batch, k.shape[1]
    return (k.shape[1], k.shape[2]) if kv_layout == "heads" else (k.shape[2], k.shape[1])


@precision.float32_full
def scaled_dot_product_attention(q, k, v, *, mask=None, is_causal=False, q_offset=0, scale=None,
                                 return_weights=False, kv_layout="tokens", dropout_rate=0.0, dropout_rng=None,
                                 softcap=None, window=None):
    """softmax(q k^T * scale + mask) v, per head, with grouped key/value heads.

    q: (B, Tq, H, D). k, v in ``kv_layout`` (KV_LAYOUTS). H must be a multiple of H_kv (GQA;
    H_kv = 1 is MQA).
    mask: bool, broadcastable to (B, H, Tq, Tk); True means *attend*. Any other dtype or shape is a
    ValueError (a float 0/-inf mask cast to bool would invert it; a (B, T) mask would be read as (Tq, Tk)).
    is_causal: query i sees keys j <= q_offset + i (q_offset may be a traced cache index), and with
    a sliding ``window`` W (int or traced) only keys j > q_offset + i - W.
    scale: defaults to 1/sqrt(D). softcap: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2).
    A query row with no visible key returns zeros (as torch's SDPA does), not the mean of v.
    Returns out (B, Tq, H, D), and weights (B, H, Tq, Tk) float32 if ``return_weights``.
    """
    b, tq, h, d = q.shape
    h_kv, tk = kv_shape(k, kv_layout, b)
    if h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    g = h // h_kv
    scale = d ** -0.5 if scale is None else scale

    if kv_layout == "rows":
        # One (B * H_kv) batch of (S, D) matrices: the layout XLA's CPU dot reads in place, so a
        # decode step neither reshapes nor copies the freshly written cache (docs/decoding.md).
        qn = q.reshape(b, tq, h_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * h_kv, g * tq, d)  # (N, G*Tq, D)
        scores = jnp.einsum("nqd,nkd->nqk", qn, k, preferred_element_type=jnp.float32) * scale
        scores = scores.reshape(b, h_kv, g, tq, tk)
    else:
        kspec = "bhkd" if kv_layout == "heads" else "bkhd"
        qg = q.reshape(b, tq, h_kv, g, d)  # head = kv_head * g + group, as torch's enable_gqa
        scores = jnp.einsum(f"bqhgd,{kspec}->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale

    scores = capped(scores, softcap)
    allowed = None
    if mask is not None:
        m = jnp.asarray(mask)
        validate.check_mask(m.shape, m.dtype, (b, h, tq, tk))
        allowed = grouped_mask(m, h_kv, g)  # (B|1, H_kv|1, G|1, Tq|1, Tk)
    if is_causal:
        allowed = both(allowed, causal_mask(tq, tk, q_offset, window=window))
    if allowed is not None:
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # (B, H_kv, G, Tq, Tk)
    if mask is not None:  # causal alone always leaves the query's own key visible (q_offset >= 0): no empty rows
        weights = jnp.where(allowed.any(-1, keepdims=True), weights, 0.0)
    probs = weights
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    if kv_layout == "rows":
        out = jnp.einsum("nqk,nkd->nqd", probs.reshape(b * h_kv, g * tq, tk).astype(v.dtype), v)  # (N, G*Tq, D)
        out = out.reshape(b, h_kv, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d)
    else:
        vspec = "bhkd" if kv_layout == "heads" else "bkhd"
        out = jnp.einsum(f"bhgqk,{vspec}->bqhgd", probs.astype(v.dtype), v).reshape(b, tq, h, d)
    if return_weights:
        return out, weights.reshape(b, h, tq, tk)
    return out
