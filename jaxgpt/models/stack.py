"""The layer stack every model runs: token checks, embeddings, and ``run_blocks``, the Blocks under
``nn.scan`` (one compiled layer body; params with a leading layer axis) or as separate ``layers_{i}``,
with or without a KV cache. DecoderLM (decoder.py), BertClassifier (bert.py) and EncoderDecoder
(encdec.py) are each a head and embeddings around it.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.nn import checks
from jaxgpt.core import validate
from jaxgpt.nn.kv_cache import KVCache
from jaxgpt.nn.block import Block
from jaxgpt.nn.kernels.linear import stacked_weights
from jaxgpt.nn.kernels.masks import NO_WINDOW
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.config.execution import DEFAULT_EXECUTION
from jaxgpt.nn.kernels.exec_policy import scan_unroll
from jaxgpt.nn.positions import sinusoidal_table


def check_tokens(tokens, vocab_size: int, max_len: int, offset: int = 0) -> None:
    """Raise ValueError for ids outside [0, vocab_size) or sequences past the context window.

    JAX gathers clamp bad indices silently, so concrete (eager) inputs are checked here on the
    host; traced inputs (under jit) get the same checks as checkify debug checks (checks.debug_check), reported in
    checked mode (``jaxgpt.nn.checks.checked``) and compiled away otherwise.
    """
    t, traced = tokens.shape[-1], jax.core.Tracer
    if not isinstance(offset, traced):
        offset = int(offset)
        if offset + t > max_len:
            raise ValueError(f"{t} tokens after {offset} cached positions exceed max_len={max_len}")
    elif t > max_len:
        raise ValueError(f"{t} tokens exceed max_len={max_len}")
    elif checks.STATE.on:  # checked mode only: elsewhere the check would be dead ops in the program
        checks.debug_check(offset + t <= max_len, f"{t} tokens after {{offset}} cached positions exceed "
                             f"max_len={max_len}", offset=offset)
    if not isinstance(tokens, traced):
        validate.check_ids(tokens, vocab_size)
    elif checks.STATE.on:
        checks.check_in_range(tokens, vocab_size, "token id")


def embed_tokens(config: ModelConfig, tok_embed: nn.Embed, tokens, positions, deterministic: bool):
    """Token (+ absolute position) embeddings with dropout. Call inside a compact module."""
    cfg = config
    init = nn.initializers.normal(cfg.init_std)
    x = tok_embed(tokens)  # (B, T, d) in the compute dtype: the residual stream's dtype from here on
    if cfg.pad_token_id is not None:
        # torch's nn.Embedding(padding_idx) gives the padding row no gradient from the lookup (a tied head
        # still updates it): the same values, with the gradient of the padding positions stopped.
        x = jnp.where((tokens == cfg.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
    if cfg.embed_scale:
        x = x * jnp.asarray(np.sqrt(cfg.d_model), x.dtype)  # not a float32 scalar: it would promote x
    if cfg.pos == "learned":
        x = x + nn.Embed(cfg.max_len, cfg.d_model, embedding_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         name="pos_embed")(positions)
    elif cfg.pos == "sinusoidal":
        x = x + jnp.asarray(sinusoidal_table(cfg.max_len, cfg.d_model))[positions].astype(x.dtype)
    return nn.Dropout(cfg.dropout)(x, deterministic=deterministic)


SCANNED_COLLECTIONS = {"params": 0, "intermediates": 0, "router": 0}  # what nn.scan stacks per layer


def remat_policy(name: str):
    """``Execution.remat`` -> the jax.checkpoint policy passed to nn.remat ('full': save nothing)."""
    return None if name == "full" else getattr(jax.checkpoint_policies, name)


def scanned_windows(config: ModelConfig):
    """The sliding window of the one scanned layer body: (a static window (int or None) every layer
    shares, None) or, where window_layers mixes sliding and global layers, (None, an (L,) int32 array
    scanned as an input, masks.NO_WINDOW for the global layers)."""
    windows = [config.layer_window(i) for i in range(config.n_layer)]
    if len(set(windows)) == 1:
        return windows[0], None
    return None, jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)


def run_blocks(config: ModelConfig, x, *, causal=True, cross=False, context=None, mask=None,
               context_mask=None, positions=None, cache=None, return_weights=False, deterministic=True,
               name="layers", segment_ids=None, execution: Execution = DEFAULT_EXECUTION):
    """n_layer Blocks. Call inside a compact module. Returns (x, cache, weights).

    ``execution.scan_layers``: one Block under nn.scan (params (L, ...) under ``name``, unrolled
    ``scan_unroll(execution, n_layer)`` layers per loop iteration), or a Python loop over Blocks named
    ``{name}_0, {name}_1, ...`` (one compiled body per layer). Either way the cache and the
    weights are stacked (L, ...). ``execution.remat`` wraps each layer in nn.remat. Sliding windows: each
    separate layer gets its own (``config.layer_window``); scanned layers share one body, so a mix of
    sliding and global layers scans its windows as an input (``scanned_windows``).
    """

    def body(block, h, xs):  # xs: (the layer's cache or None, its window: None, an int or a scanned int32)
        layer_cache, window = xs
        h, new_cache, w = block(h, context, mask=mask, context_mask=context_mask, positions=positions,
                                cache=layer_cache, return_weights=return_weights, deterministic=deterministic,
                                segment_ids=segment_ids, window=window)
        return h, (new_cache, w)

    if cache is not None:
        return _run_blocks_cached(config, execution, body, x, cache, causal=causal, cross=cross, name=name)
    ex = execution
    if ex.remat != "none":
        # Inside a rolled scan the loop already keeps XLA from merging the recomputation back into the
        # forward pass, so the optimisation barriers of prevent_cse are only needed for separate or
        # unrolled layers (JAX docs; unrolled without them, remat='full' saved no memory).
        rolled = ex.scan_layers and scan_unroll(ex, config.n_layer) == 1
        body = nn.remat(body, policy=remat_policy(ex.remat), prevent_cse=not rolled)
    if not ex.scan_layers:
        outs = []
        for i in range(config.n_layer):
            x, out = body(Block(config, ex, causal=causal, cross=cross, sparse=config.sparse_layer(i), name=f"{name}_{i}"),
                          x, (None, config.layer_window(i)))
            outs.append(out)
        cache, weights = jax.tree.map(lambda *a: jnp.stack(a), *outs)  # (L, ...) as the scan stacks them
        return x, cache, weights

    # "intermediates": 0 stacks what capture_intermediates / sow record per layer (jaxgpt.tools.parity reads
    # each Block's output from it); without that collection mutable, nothing changes.
    # "router": 0 stacks the MoE router statistics (jaxgpt.nn.moe) the same way.
    static, windows = scanned_windows(config)
    scan = nn.scan(lambda block, h, xs: body(block, h, (xs[0], static if xs[1] is None else xs[1])),
                   variable_axes=SCANNED_COLLECTIONS, split_rngs={"params": True, "dropout": True},
                   in_axes=0, length=config.n_layer, unroll=scan_unroll(ex, config.n_layer))
    with stacked_weights():
        x, (cache, weights) = scan(Block(config, ex, causal=causal, cross=cross, sparse=config.sparse_layer(0), name=name),
                                   x, (cache, windows))
    return x, cache, weights


def _run_blocks_cached(config: ModelConfig, ex: Execution, body, x, cache, *, causal, cross, name):
    """run_blocks with a KV cache, never moving the cache through nn.scan's xs/ys.

    Scanning it as xs/ys (slice out k[l], stack the new k[l] back) made XLA allocate, fill and copy
    cache-sized buffers on every call, so per-token decode cost grew with the cache's size. Here a
    per-layer cache (a tuple of one-layer KVCaches) goes to its layer as is; a 'stacked' cache rides
    through the layer loop whole and each layer writes only its new slots of k[l], v[l] (KVCache.layer = l).
    No remat: decoding has no backward pass.
    """
    if not isinstance(cache, KVCache):  # per-layer: L one-layer KVCaches ('rows' or 'heads')
        if len(cache) != config.n_layer:
            raise ValueError(f"a per-layer cache needs n_layer={config.n_layer} KVCaches, got {len(cache)}")
        if any(c.layout == "stacked" for c in cache):
            raise ValueError("a per-layer cache holds one-layer KVCaches ('rows' or 'heads'), not 'stacked' ones")
        if ex.scan_layers:  # the scanned layers need it stacked: stack, run, split (copies)
            b = x.shape[0]
            stack = lambda *a: jnp.stack([c.reshape(b, -1, *c.shape[-2:]) for c in a])  # rows split into heads
            stacked = KVCache(stack(*[c.k for c in cache]), stack(*[c.v for c in cache]),
                              jnp.stack([c.index for c in cache]), "stacked")
            x, st, weights = _run_blocks_cached(config, ex, body, x, stacked, causal=causal, cross=cross, name=name)
            split = [KVCache(st.k[i].reshape(c.k.shape), st.v[i].reshape(c.v.shape), st.index[i], c.layout)
                     for i, c in enumerate(cache)]
            return x, tuple(split), weights
        new, ws = [], []
        for i, layer_cache in enumerate(cache):
            x, (c, w) = body(Block(config, ex, causal=causal, cross=cross, sparse=config.sparse_layer(i), name=f"{name}_{i}"),
                             x, (layer_cache, config.layer_window(i)))
            new.append(c)
            ws.append(w)
        weights = None if ws[0] is None else jnp.stack(ws)
        return x, tuple(new), weights
    if cache.layout != "stacked":
        raise ValueError(f"DecoderLM takes init_cache's caches: one 'stacked' KVCache or a tuple of n_layer "
                         f"one-layer KVCaches; got a single {cache.layout!r} KVCache")

    static, windows = scanned_windows(config)

    def layer_body(block, carry, xs):  # carry: (h, k, v), xs: (layer, index, window) -> ys: (index, weights)
        h, k, v = carry
        h, (new, w) = body(block, h, (KVCache(k, v, xs[1], "stacked", xs[0]), xs[2]))
        return (h, new.k, new.v), (new.index, w)

    if not ex.scan_layers:
        carry, outs = (x, cache.k, cache.v), []
        for i in range(config.n_layer):  # a static layer index: plain slices of the stacked cache
            block = Block(config, ex, causal=causal, cross=cross, sparse=config.sparse_layer(i), name=f"{name}_{i}")
            carry, out = layer_body(block, carry, (i, cache.index[i], config.layer_window(i)))
            outs.append(out)
        index, weights = jax.tree.map(lambda *a: jnp.stack(a), *outs)  # (L, ...) as the scan stacks them
    else:
        scan = nn.scan(lambda block, c, xs: layer_body(block, c, xs[:2] + (static if xs[2] is None else xs[2],)),
                       variable_axes=SCANNED_COLLECTIONS,
                       split_rngs={"params": True, "dropout": True}, in_axes=0, length=config.n_layer,
                       unroll=scan_unroll(ex, config.n_layer))
        layers = jnp.arange(config.n_layer, dtype=jnp.int32)
        with stacked_weights():
            carry, (index, weights) = scan(Block(config, ex, causal=causal, cross=cross, sparse=config.sparse_layer(0),
                                                 name=name), (x, cache.k, cache.v), (layers, cache.index, windows))
    x, k, v = carry
    return x, KVCache(k, v, index, "stacked"), weights
