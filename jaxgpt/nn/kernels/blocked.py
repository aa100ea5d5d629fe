"""attention_impl='blocked': flash-style attention in JAX. An online softmax over key/value blocks
and a custom VJP that recomputes block scores from the saved logsumexp, so forward and backward
hold O(T * block) scores instead of O(Tq * Tk)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxgpt.nn.kernels import precision
from jaxgpt.nn.kernels.masks import both, causal_mask, grouped_mask, keys_before, segment_mask
from jaxgpt.nn.kernels.softcap import softcap as capped, softcap_grad

class _Static(NamedTuple):
    causal: bool
    scale: float
    bq: int  # query block
    bk: int  # key/value block
    tk: int  # true key length (keys at or past it are padding)
    # the matmul precision in force at the forward call (jaxgpt.nn.kernels.precision): the backward pass is
    # traced after the module call returns, outside its precision scope
    precision: str | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)


def _block_scores(cfg: _Static, qi, kj, i, j, mask, pos, seg=None):
    """Scaled scores of query block i against key block j, -inf where not allowed.
    qi: (B, K, G, bq, D); kj: (B, K, bk, D); mask: (B|1, K|1, G|1, Tq|1, Tk|1) or None;
    pos: (q_offset, sliding window or None), int32 scalars;
    seg: segment ids of the (padded) queries and keys, ((B, Tq'), (B, Tk')), or None."""
    s = capped(jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32) * cfg.scale, cfg.softcap)
    allowed = None
    if seg is not None:  # (B, 1, 1, bq, bk): this block pair's part of the segment mask, never the whole
        qs = lax.dynamic_slice_in_dim(seg[0], i * cfg.bq, cfg.bq, 1)
        ks = lax.dynamic_slice_in_dim(seg[1], j * cfg.bk, cfg.bk, 1)
        allowed = segment_mask(qs, ks)[:, :, None]
    if mask is not None:
        mb = mask if mask.shape[3] == 1 else lax.dynamic_slice_in_dim(mask, i * cfg.bq, cfg.bq, 3)
        allowed = both(allowed, mb if mb.shape[4] == 1 else lax.dynamic_slice_in_dim(mb, j * cfg.bk, cfg.bk, 4))
    if cfg.causal:
        allowed = both(allowed, causal_mask(cfg.bq, cfg.bk, pos[0], q_start=i * cfg.bq, k_start=j * cfg.bk,
                                            window=pos[1]))
    if cfg.tk % cfg.bk:  # the last block's padded keys
        allowed = both(allowed, keys_before(cfg.bk, cfg.tk, k_start=j * cfg.bk))
    return s if allowed is None else jnp.where(allowed, s, -jnp.inf)


def _kv_blocks_for(cfg: _Static, i, pos, nk):
    """Key blocks [lo, hi) query block i needs: all, or (causal) up to the one holding its last
    visible key, from the one holding its first (a sliding window's lower edge)."""
    if not cfg.causal:
        return 0, nk
    q_offset, window = pos
    hi = jnp.clip(((i + 1) * cfg.bq + q_offset + cfg.bk - 1) // cfg.bk, 0, nk)
    if window is None:
        return 0, hi
    return jnp.clip((i * cfg.bq + q_offset - window + 1) // cfg.bk, 0, hi), hi


def _forward(cfg: _Static, q, k, v, mask, pos, seg):
    """Online softmax over key blocks for each query block. q: (B, K, G, Tq', D) padded to bq;
    k, v: (B, K, Tk', D) padded to bk. Returns out (same shape as q) and logsumexp (B, K, G, Tq')
    with +inf on rows that see no key (so the backward's exp(s - lse) is 0 there)."""
    b, hk, g, tqp, d = q.shape
    nq, nk = tqp // cfg.bq, k.shape[2] // cfg.bk

    def q_block(i):
        qi = lax.dynamic_slice_in_dim(q, i * cfg.bq, cfg.bq, 3)  # (B, K, G, bq, D)

        def step(j, carry):
            m, l, acc = carry  # (B, K, G, bq), same, (B, K, G, bq, D) float32
            kj = lax.dynamic_slice_in_dim(k, j * cfg.bk, cfg.bk, 2)
            vj = lax.dynamic_slice_in_dim(v, j * cfg.bk, cfg.bk, 2)
            s = _block_scores(cfg, qi, kj, i, j, mask, pos, seg)  # (B, K, G, bq, bk)
            m_new = jnp.maximum(m, s.max(-1))
            m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all -inf so far: keep exp() finite
            p = jnp.exp(s - m_use[..., None])
            alpha = jnp.exp(m - m_use)  # rescale what earlier blocks accumulated
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), vj,
                                                      preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((b, hk, g, cfg.bq), -jnp.inf, jnp.float32), jnp.zeros((b, hk, g, cfg.bq), jnp.float32),
                jnp.zeros((b, hk, g, cfg.bq, d), jnp.float32))
        m, l, acc = lax.fori_loop(*_kv_blocks_for(cfg, i, pos, nk), step, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = lax.map(q_block, jnp.arange(nq))  # (nq, B, K, G, bq, D), (nq, B, K, G, bq)
    out = jnp.moveaxis(out, 0, 3).reshape(b, hk, g, tqp, d)
    return out, jnp.moveaxis(lse, 0, 3).reshape(b, hk, g, tqp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, mask, pos, seg):
    return _forward(cfg, q, k, v, mask, pos, seg)[0]


def _flash_fwd(cfg, q, k, v, mask, pos, seg):
    out, lse = _forward(cfg, q, k, v, mask, pos, seg)
    return out, (q, k, v, mask, pos, seg, out, lse)  # linear in T: no (Tq, Tk) residual


def _flash_bwd(cfg, res, dout):
    """FlashAttention-2 backward: for each key block, recompute the scores of the query blocks that
    can see it from the saved logsumexp; dk, dv per key block, dq accumulated in a carry."""
    if cfg.precision is None:
        return _flash_bwd_body(cfg, res, dout)
    with jax.default_matmul_precision(cfg.precision):
        return _flash_bwd_body(cfg, res, dout)


def _flash_bwd_body(cfg, res, dout):
    q, k, v, mask, pos, seg, out, lse = res
    b, hk, g, tqp, d = q.shape
    nq, nk = tqp // cfg.bq, k.shape[2] // cfg.bk
    delta = jnp.einsum("bhgqd,bhgqd->bhgq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def kv_block(dq, j):
        kj = lax.dynamic_slice_in_dim(k, j * cfg.bk, cfg.bk, 2)  # (B, K, bk, D)
        vj = lax.dynamic_slice_in_dim(v, j * cfg.bk, cfg.bk, 2)

        def step(i, carry):
            dq, dk, dv = carry
            qi = lax.dynamic_slice_in_dim(q, i * cfg.bq, cfg.bq, 3)
            doi = lax.dynamic_slice_in_dim(dout, i * cfg.bq, cfg.bq, 3)
            s = _block_scores(cfg, qi, kj, i, j, mask, pos, seg)
            p = jnp.exp(s - lax.dynamic_slice_in_dim(lse, i * cfg.bq, cfg.bq, 3)[..., None])  # (B, K, G, bq, bk)
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - lax.dynamic_slice_in_dim(delta, i * cfg.bq, cfg.bq, 3)[..., None]) * cfg.scale
            if cfg.softcap is not None:  # through the cap's tanh
                ds = ds * softcap_grad(s, cfg.softcap)
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
            dqi = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, i * cfg.bq, cfg.bq, 3) + dqi,
                                                 i * cfg.bq, 3)
            return dq, dk, dv

        # causal: the first query block with a query at or past this block's first key, and (sliding
        # window W) the block after the last query whose window still reaches this block's last key
        lo, hi = (jnp.clip((j * cfg.bk - pos[0]) // cfg.bq, 0, nq), nq) if cfg.causal else (0, nq)
        if cfg.causal and pos[1] is not None:
            hi = jnp.clip(-(-((j + 1) * cfg.bk - 1 + pos[1] - pos[0]) // cfg.bq), lo, nq)
        zeros = jnp.zeros((b, hk, cfg.bk, d), jnp.float32)
        dq, dk, dv = lax.fori_loop(lo, hi, step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(kv_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)  # (nk, B, K, bk, D) -> (B, K, Tk', D)
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0 or x.shape[axis] == 1:  # a broadcast (size-1) mask axis stays broadcast
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


@precision.float32_full
def blocked_attention(q, k, v, *, mask=None, is_causal=False, q_offset=0, scale=None, kv_layout="tokens",
                      block=128, segment_ids=None, softcap=None, window=None):
    """Flash-style attention: loops over query blocks and key/value blocks of ``block`` positions with
    an online softmax, and a custom VJP that recomputes block scores from the saved logsumexp, so
    forward and backward hold O(T * block) scores instead of O(Tq * Tk). Lengths that are not a
    multiple of ``block`` are padded internally (padded keys masked). GQA groups query heads over
    each key/value head; K/V are never repeated. Same contract as scaled_dot_product_attention,
    with k, v in kv_layout 'tokens' or 'heads'. ``segment_ids`` (B, T): packed documents in
    self-attention (Tq == Tk), compared block pair by block pair. ``softcap``: scores -> softcap *
    tanh(scores / softcap) before the mask, in the forward and the recomputed backward. A sliding
    ``window`` (causal; int or traced) masks keys inside the blocks and skips the blocks wholly before it."""
    if block < 1:
        raise ValueError(f"attention_block must be >= 1, got {block}")
    b, tq, h, d = q.shape
    if kv_layout == "tokens":  # (B, Tk, K, D) -> (B, K, Tk, D): O(T) copy, contiguous key blocks
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    hk, tk = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk})")
    g = h // hk
    cfg = _Static(bool(is_causal), float(d ** -0.5 if scale is None else scale), min(block, tq), min(block, tk), tk,
                  precision.current(), None if softcap is None else float(softcap))
    tqp, tkp = -(-tq // cfg.bq) * cfg.bq, -(-tk // cfg.bk) * cfg.bk
    qg = q.reshape(b, tq, hk, g, d).transpose(0, 2, 3, 1, 4)  # (B, K, G, Tq, D); head = kv_head * G + group
    qg, k, v = _pad_to(qg, 3, tqp), _pad_to(k, 2, tkp), _pad_to(v, 2, tkp)
    m = None
    if mask is not None:
        m = grouped_mask(mask, hk, g)
        m = _pad_to(_pad_to(m, 3, tqp, False), 4, tkp, False)  # (B|1, K|1, G|1, Tq'|1, Tk'|1)
    seg = None
    if segment_ids is not None:  # padded positions get id -1: padded keys are masked anyway, padded queries dropped
        seg = (_pad_to(segment_ids, 1, tqp, -1), _pad_to(segment_ids, 1, tkp, -1))
    pos = (jnp.asarray(q_offset, jnp.int32), None if window is None else jnp.asarray(window, jnp.int32))
    out = _flash(cfg, qg, k, v, m, pos, seg)  # (B, K, G, Tq', D)
    return out[:, :, :, :tq].transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d)
