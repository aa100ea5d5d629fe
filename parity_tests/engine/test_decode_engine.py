"""Decoding engine: the compiled decode loop copies no KV cache per token, compiles once per shape,
and the per-layer decode cache gives the same numbers as the stacked cache and as no cache.
These are self-consistency checks (the reference is jaxgpt's own uncached forward, whose
parity with torch_ref is proven in test_decoder.py and test_generate.py).

Tolerances: logits of cached vs uncached forwards in float32 within 1e-5 (max abs, unit-scale
logits); greedy tokens identical.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpt.inference.generate as gen_module
from jaxgpt.nn.attention import KVCache
from jaxgpt.config import Execution, ModelConfig
from jaxgpt.inference.generate import generate
from jaxgpt.models import build, init_params
from jaxgpt.models.decoder import init_cache, unstack_layers

# GQA + RoPE (the cache's trickiest layout) and a GPT-2-like learned-position config.
LLAMA = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_len=64, pos="rope")
GPT2 = ModelConfig(vocab_size=48, d_model=32, n_layer=3, n_head=4, max_len=64, pos="learned", norm="layernorm",
                   mlp="gelu", mlp_bias=True, qkv_bias=True, o_bias=True, tie_embeddings=True)
PROMPT = np.random.default_rng(0).integers(0, 48, (2, 5)).astype(np.int32)


@functools.cache
def _params(cfg, seed=0, ex=None):
    return init_params(cfg, jax.random.PRNGKey(seed), ex)


# 1. HLO: what the decode loop's body materialises -------------------------------------------------
def _computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
        elif cur is not None and line.startswith("  "):
            cur.append(line.strip())
    return comps


def _elements(shape: str) -> int:
    dims = [int(d) for d in shape.split(",") if d]
    return int(np.prod(dims)) if dims else 1


def loop_materialisations(hlo: str, min_elements: int) -> list[str]:
    """Instructions inside while-loop bodies that produce an array of >= min_elements elements,
    other than in-place cache updates (dynamic-update-slice, or a fusion computing one)."""
    comps = _computations(hlo)
    todo = [b for lines in comps.values() for ln in lines for b in re.findall(r"body=%([\w.\-]+)", ln)]
    bodies, out = set(), []
    while todo:
        name = todo.pop()
        if name in bodies:
            continue
        bodies.add(name)
        for ln in comps[name]:
            todo += re.findall(r"(?:body|to_apply)=%([\w.\-]+)", ln) if " call(" in ln or " while(" in ln else []
            m = re.match(r"(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(", ln)
            if not m or _elements(m.group(2)) < min_elements:
                continue
            op = m.group(3)
            if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "dynamic-update-slice", "while"):
                continue
            called = re.search(r"calls=%([\w.\-]+)", ln)
            if op == "fusion" and called and any(" dynamic-update-slice(" in x for x in comps[called.group(1)]):
                continue
            out.append(ln[:160])
    return out


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_loop_copies_no_cache(scan_layers):
    """Each decode step writes its new K/V slots in place and reads the cache where it lies: no
    instruction of the compiled loop body materialises an array as large as one layer's cache.
    (The first implementation scanned the stacked cache through nn.scan as xs/ys: every step
    broadcast, sliced and copied the whole cache several times, 2-3x its size in temporaries.)"""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, max_len=512, pos="learned")
    ex = Execution(scan_layers=scan_layers)
    b, t0, new = 2, 4, 500
    layer_cache = b * cfg.kv_heads * (t0 + new) * cfg.head_dim  # elements of one layer's K (or V)
    assert layer_cache > max(x.size for x in jax.tree.leaves(_params(cfg, ex=ex)))  # params can't be mistaken for it
    compiled = gen_module._generate_cached.lower(
        _params(cfg, ex=ex), jnp.zeros((b, t0), jnp.int32), jax.random.PRNGKey(0), config=cfg, max_new_tokens=new,
        temperature=0.0, top_k=None, top_p=None, eos_id=None, execution=ex).compile()
    assert loop_materialisations(compiled.as_text(), layer_cache) == []
    # Temporaries: the cache itself (created in the program; the prefill may copy parts once), not 3x.
    cache_bytes = 2 * cfg.n_layer * layer_cache * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * cache_bytes


def test_materialisation_detector_sees_a_copy():
    """The detector above flags a loop that copies a cache-sized array (so an empty list means something)."""
    def f(c):
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.flip(c, 0) + 1.0, c)

    hlo = jax.jit(f).lower(jnp.zeros((64, 64))).compile().as_text()
    assert loop_materialisations(hlo, 64 * 64)


# 2. Compile counts --------------------------------------------------------------------------------
def test_generate_compiles_once_per_shape():
    cfg = GPT2.replace(vocab_size=47)  # a config no other test compiles
    p = _params(cfg)
    size = gen_module._generate_cached._cache_size()
    a = generate(cfg, p, PROMPT % cfg.vocab_size, 6)
    assert gen_module._generate_cached._cache_size() == size + 1
    b = generate(cfg, p, (PROMPT + 7) % cfg.vocab_size, 6)  # new prompt, same shape: no compile
    generate(cfg, _params(cfg, seed=1), PROMPT % cfg.vocab_size, 6)  # new weights, same shapes: no compile
    assert gen_module._generate_cached._cache_size() == size + 1
    assert not np.array_equal(a, b)
    generate(cfg, p, PROMPT % cfg.vocab_size, 7)  # another max_new_tokens: one more program
    assert gen_module._generate_cached._cache_size() == size + 2


# 3. Same numbers, every cache form and layer layout ------------------------------------------------
# Each config runs in one layer layout, each layout in one config: both layouts, both configs, half the time.
PAIRS = pytest.mark.parametrize(("cfg", "scan_layers"), [(LLAMA, True), (GPT2, False)], ids=["gqa-rope-scan", "gpt2-layers"])


@PAIRS
def test_cached_tokens_equal_uncached(cfg, scan_layers):
    ex = Execution(scan_layers=scan_layers)
    p = _params(cfg, ex=ex)
    prompt = PROMPT % cfg.vocab_size
    cached = np.asarray(generate(cfg, p, prompt, 20, execution=ex))
    assert np.array_equal(cached, np.asarray(generate(cfg, p, prompt, 20, use_cache=False, execution=ex)))


@PAIRS
def test_cache_forms_match_full_forward(cfg, scan_layers):
    """Prefill 5 tokens, then 3 single-token steps, with the 'stacked' (L, B, H_kv, S, D) cache, the
    per-layer 'rows' (B * H_kv, S, D) caches and per-layer 'heads' (B, H_kv, S, D) caches: logits
    equal the uncached forward's (1e-5), and every cache holds the same keys and values."""
    ex = Execution(scan_layers=scan_layers)
    p = _params(cfg, ex=ex)
    model = build(cfg, ex)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    full = np.asarray(model.apply({"params": p}, toks))
    caches = {"stacked": init_cache(cfg, 2, 16), "per_layer": init_cache(cfg, 2, 16, per_layer=True),
              "heads": tuple(KVCache.init(2, cfg.kv_heads, 16, cfg.head_dim) for _ in range(cfg.n_layer))}
    for form, cache in caches.items():
        logits = []
        for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 8)]:
            out = model.apply({"params": p}, toks[:, lo:hi], cache=cache)
            cache = out.cache
            logits.append(np.asarray(out.logits))
        np.testing.assert_allclose(np.concatenate(logits, 1), full, atol=1e-5, rtol=0, err_msg=form)
        caches[form] = cache
    stacked = caches["stacked"]
    assert stacked.layout == "stacked" and np.asarray(stacked.index).tolist() == [8] * cfg.n_layer
    for form in ("per_layer", "heads"):
        for i, c in enumerate(caches[form]):
            assert int(c.index) == 8 and c.layout == {"per_layer": "rows", "heads": "heads"}[form]
            np.testing.assert_allclose(np.asarray(c.k).reshape(stacked.k.shape[1:]), stacked.k[i], atol=1e-6)
            np.testing.assert_allclose(np.asarray(c.v).reshape(stacked.v.shape[1:]), stacked.v[i], atol=1e-6)


def test_per_layer_cache_padding_mask_and_weights():
    """A left-padding key mask and return_weights go through the per-layer path as through the stacked one."""
    cfg, ex = LLAMA, Execution(scan_layers=False)
    p = _params(cfg, ex=ex)
    model = build(cfg, ex)
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    mask = np.ones((2, 1, 1, 16), bool)
    mask[0, ..., :2] = False  # row 0: two pad tokens on the left
    outs = [model.apply({"params": p}, toks, cache=c, mask=mask, return_weights=True)
            for c in (init_cache(cfg, 2, 16), init_cache(cfg, 2, 16, per_layer=True))]
    np.testing.assert_allclose(outs[1].logits, outs[0].logits, atol=1e-5)
    np.testing.assert_allclose(outs[1].attn_weights, outs[0].attn_weights, atol=1e-6)
    assert float(np.abs(outs[1].attn_weights[:, 0, ..., :2]).max()) == 0.0  # masked keys get no weight


def test_cache_dtype_is_compute_dtype():
    assert init_cache(GPT2, 1).k.dtype == jnp.float32
    assert init_cache(GPT2.replace(dtype="bfloat16"), 1, per_layer=True)[0].k.dtype == jnp.bfloat16
    assert init_cache(GPT2, 1, dtype=jnp.float16).v.dtype == jnp.float16


def test_unstack_layers_gives_the_unscanned_layout():
    cfg = GPT2
    flat_ex, flat = unstack_layers(cfg, _params(cfg))
    assert not flat_ex.scan_layers
    want = jax.tree.map(lambda a: a.shape, init_params(cfg, jax.random.PRNGKey(0), Execution(scan_layers=False)))
    assert jax.tree.map(lambda a: a.shape, flat) == want
    toks = PROMPT % cfg.vocab_size
    np.testing.assert_allclose(build(cfg, flat_ex).apply({"params": flat}, toks),
                               build(cfg).apply({"params": _params(cfg)}, toks), atol=1e-6, rtol=0)


# 4. Errors ----------------------------------------------------------------------------------------
def test_per_layer_cache_errors():
    cfg, ex = LLAMA, Execution(scan_layers=False)
    p = _params(cfg, ex=ex)
    model = build(cfg, ex)
    toks = jnp.ones((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="per-layer cache needs n_layer=2 KVCaches, got 1"):
        model.apply({"params": p}, toks, cache=init_cache(cfg, 2, 8, per_layer=True)[:1])
    with pytest.raises(ValueError, match=r"a 'rows' KV cache of shape \(2, 8, 8\) does not fit batch 2 x 2 key/value "
                                         r"heads of size 8: it needs \(4, 8, 8\)"):
        model.apply({"params": p}, toks, cache=init_cache(cfg, 1, 8, per_layer=True))
    with pytest.raises(ValueError, match="one 'stacked' KVCache or a tuple of n_layer one-layer KVCaches; got a "
                                         "single 'rows' KVCache"):
        model.apply({"params": p}, toks, cache=init_cache(cfg, 2, 8, per_layer=True)[0])
    with pytest.raises(ValueError, match="a per-layer cache holds one-layer KVCaches"):
        model.apply({"params": p}, toks, cache=(init_cache(cfg, 2, 8),) * cfg.n_layer)
    with pytest.raises(ValueError, match="KV cache overflow: 0 cached"):  # capacity checked for per-layer caches too
        model.apply({"params": p}, jnp.ones((2, 9), jnp.int32), cache=init_cache(cfg, 2, 8, per_layer=True))
    assert isinstance(init_cache(cfg, 2, 8, per_layer=True)[0], KVCache)
