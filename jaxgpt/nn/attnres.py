"""Attention Residuals (Kimi Team, arXiv 2603.15031; seed 002): each sublayer reads a softmax
mixture over depth of earlier outputs instead of the running residual sum.

    alpha_i = softmax_i(w . RMSNorm(v_i)),   h = sum_i alpha_i v_i,   v_i: (B, T, d) sources

``config.residual``: 'full_attnres' (every sublayer output is a source) or 'block_attnres'
(sources are the embedding and sums of sublayer outputs over blocks of layers).
``config.attnres_variant``:

- 'seed': seed 002's code exactly. Sources start as [embedding]; one zero-init pseudo-query per
  sublayer (``w_attn``, ``w_mlp``) and one learnable key RMSNorm per layer (``key_norm``).
  Full: the output is the last MLP output. Block: the partial block (zeros at the start) is
  always a source; it is sealed after the *attention* sublayer of layer i when
  (i + 1) % block_size == 0 (block_size = max(1, n_layer // attnres_blocks)) and reset to zeros;
  the output is ``partial if sum|partial| > 0 else blocks[-1]`` (a jnp.where, so it jits).
- 'paper': one pseudo-query and one key RMSNorm per sublayer (``w_attn`` + ``attn_key_norm``,
  ``w_mlp`` + ``mlp_key_norm``). Block 0 is the embedding; a block is the sum of the sublayer
  outputs of layers_per_block = max(1, n_layer // attnres_blocks) layers, sealed after a layer's
  MLP, at most attnres_blocks blocks (the remainder joins the last one); an empty partial block
  is not a source (no zero-valued sources). The output is a last zero-init aggregation over all
  sources (``w_out``, ``out_key_norm``), which the model's final norm then normalises.

Choices the paper leaves open, set by the config: the key RMSNorm has a learnable gain when
``attnres_key_gain`` (the seed's nn.RMSNorm has one) and eps ``attnres_eps`` (None: ``norm_eps``).
Sublayers are the library's ``attn_norm``/``attn``/``mlp_norm``/``mlp`` as in ``Block``; the
key norm is always an RMSNorm whatever ``config.norm``; sublayer outputs get ``config.dropout``.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.nn.attention import attention_from_config
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.core.layout import key_eps, seal_schedule  # framework-free: torch_ref shares them
from jaxgpt.nn.mlp import make_mlp
from jaxgpt.nn.norms import jax_rsqrt, norm_from_config


class KeyNorm(nn.Module):
    """RMSNorm of the depth-attention keys, optional gain ``scale``. x: (..., d)."""

    eps: float
    gain: bool = True
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        """Returns float32 keys whatever x's dtype: they feed the depth softmax's logits."""
        h = x.astype(jnp.float32)
        y = h * jax_rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        if self.gain:
            y = y * self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype).astype(jnp.float32)
        return y


def depth_attention(query, key_norm, sources):
    """query (d,), sources (N, B, T, d) -> (h (B, T, d) in sources' dtype, alpha (N, B, T) float32);
    softmax over N. Logits, softmax and the mixture are float32 (the precision policy's softmax)."""
    logits = jnp.einsum("d,nbtd->nbt", query.astype(jnp.float32), key_norm(sources))  # (N, B, T)
    alpha = jax.nn.softmax(logits, axis=0)
    h = jnp.einsum("nbt,nbtd->btd", alpha, sources, preferred_element_type=jnp.float32)
    return h.astype(sources.dtype), alpha


def pad_depth_weights(alphas):
    """[(N_q, B, T)] per query -> (Q, B, T, N_max), zero beyond each query's N_q sources."""
    n = max(a.shape[0] for a in alphas)
    return jnp.stack([jnp.pad(a, ((0, n - a.shape[0]), (0, 0), (0, 0))) for a in alphas]).transpose(0, 2, 3, 1)


class AttnResLayer(nn.Module):
    """One transformer layer (attention then MLP sublayer), each reading a depth mixture.

    Params: attn_norm, attn, mlp_norm, mlp, w_attn (d,), w_mlp (d,) and key_norm (seed) or
    attn_key_norm / mlp_key_norm (paper). ``seal``: seal the partial block after this sublayer.
    """

    config: ModelConfig
    seal: str | None = None
    execution: Execution = Execution()  # the kernels (jaxgpt.config.execution)

    @nn.compact
    def __call__(self, sources, partial, *, mask=None, positions=None, return_weights=False, deterministic=True,
                 segment_ids=None):
        """sources: list of (B, T, d); partial: (B, T, d) or None (Full, or an empty paper block).
        Returns (sources, partial, attention weights (B, H, T, T) or None, [alpha (N, B, T)] x 2)."""
        cfg = self.config
        seed, full = cfg.attnres_variant == "seed", cfg.residual == "full_attnres"
        shared = KeyNorm(key_eps(cfg), cfg.attnres_key_gain, cfg.param_dtype, name="key_norm") if seed else None
        drop = nn.Dropout(cfg.dropout)
        out = {}

        def attn(h):
            y, _, out["weights"] = attention_from_config(cfg, "attn", execution=self.execution)(
                h, mask=mask, is_causal=True, positions=positions, return_weights=return_weights,
                deterministic=deterministic, segment_ids=segment_ids)
            return y

        alphas = []
        for kind, f in (("attn", attn), ("mlp", make_mlp(cfg, "mlp", self.execution))):
            query = self.param(f"w_{kind}", nn.initializers.zeros, (cfg.d_model,), cfg.param_dtype)
            key_norm = shared if seed else KeyNorm(key_eps(cfg), cfg.attnres_key_gain, cfg.param_dtype, name=f"{kind}_key_norm")
            srcs = sources if partial is None else sources + [partial]
            h, alpha = depth_attention(query, key_norm, jnp.stack(srcs))  # (B, T, d), (N, B, T)
            alphas.append(alpha)
            norm = norm_from_config(cfg, f"{kind}_norm", self.execution)
            y = drop(f(norm(h)), deterministic=deterministic)  # (B, T, d)
            if full:
                sources = sources + [y]
                continue
            partial = y if partial is None else partial + y
            if self.seal == kind:
                sources, partial = sources + [partial], (jnp.zeros_like(partial) if seed else None)
        return sources, partial, out["weights"], alphas


class AttnResLayers(nn.Module):
    """The n_layer AttnRes layers ``layers_{i}`` (+ ``w_out``, ``out_key_norm`` in 'paper').

    ``__call__(x (B, T, d))`` -> (h (B, T, d) before the model's final norm, attention weights
    (L, B, H, T, T) if ``return_weights`` else None), plus the depth weights (Q, B, T, N_max) as
    a third element if ``return_depth_weights``: one row per pseudo-query (2L sublayers, then the
    output aggregation in 'paper'), softmax over the last axis in source order, zero-padded past
    that query's sources. They are also sown as intermediates 'depth_weights' when that
    collection is mutable (``DecoderLM.apply(..., mutable=['intermediates'])``).
    """

    config: ModelConfig
    execution: Execution = Execution()  # the kernels (jaxgpt.config.execution)

    @nn.compact
    def __call__(self, x, *, mask=None, positions=None, return_weights=False, return_depth_weights=False,
                 deterministic=True, segment_ids=None):
        cfg = self.config
        seed, full = cfg.attnres_variant == "seed", cfg.residual == "full_attnres"
        sources = [x]  # (B, T, d) each; the embedding is source / block 0
        partial = jnp.zeros_like(x) if seed and not full else None
        weights, alphas = [], []
        for i, seal in enumerate(seal_schedule(cfg)):
            sources, partial, w, a = AttnResLayer(cfg, seal=seal, execution=self.execution, name=f"layers_{i}")(
                sources, partial, mask=mask, positions=positions, return_weights=return_weights,
                deterministic=deterministic, segment_ids=segment_ids)
            weights.append(w)
            alphas += a
        if seed and full:
            h = sources[-1]  # the last MLP output
        elif seed:
            h = jnp.where(jnp.abs(partial).sum() > 0, partial, sources[-1])
        else:
            query = self.param("w_out", nn.initializers.zeros, (cfg.d_model,), cfg.param_dtype)
            srcs = sources if partial is None else sources + [partial]
            h, alpha = depth_attention(query, KeyNorm(key_eps(cfg), cfg.attnres_key_gain, cfg.param_dtype, name="out_key_norm"),
                                       jnp.stack(srcs))
            alphas.append(alpha)
        weights = jnp.stack(weights) if return_weights else None
        depth = None
        if return_depth_weights or self.is_mutable_collection("intermediates"):
            depth = pad_depth_weights(alphas)  # (Q, B, T, N_max)
            self.sow("intermediates", "depth_weights", depth)
        return (h, weights, depth) if return_depth_weights else (h, weights)
