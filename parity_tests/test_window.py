"""Sliding-window attention (ModelConfig.sliding_window / window_layers): the mask against
transformers' own rule, every attention kernel against 'xla' with a window (static and traced, forward
and gradients, decode offsets, the C++ training, cache and paged kernels; a traced window the
training kernel refuses or is routed away from), the engine's pages bounded by the window, and
DecoderLM against torch_ref (forward, gradients, greedy decoding past the window) with every layer
sliding and with sliding and global layers mixed, scanned and not."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import (assert_as_accurate_as_torch, assert_close, assert_grads_close, float64_module, float64_torch,
                      load_into, random_params, torch_grads)
from jaxgpt import PRESETS, build
from jaxgpt.config import Execution, ModelConfig, RopeScaling
from jaxgpt.inference.generate import generate
from jaxgpt.nn import kernels
from jaxgpt.nn.kernels import attend, causal_ffi, paged, paged_ffi, scaled_dot_product_attention as sdpa
from torch_ref import build as tbuild
from torch_ref.generate import generate as tgenerate
from torch_ref.nn.attention import scaled_dot_product_attention as torch_sdpa


def _qkv(b, tq, tk, h, hk, d=8, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((b, tq, h, d), (b, tk, hk, d), (b, tk, hk, d))]


def window_rule(t, off, window):
    """transformers' sliding_window_causal_mask_function (masking_utils.py), written out: query
    q_idx sees kv_idx when kv_idx <= q_idx and kv_idx > q_idx - sliding_window. (T, T + off)."""
    q_idx, kv_idx = np.arange(t)[:, None] + off, np.arange(t + off)[None, :]
    return (kv_idx <= q_idx) & (kv_idx > q_idx - window)


@pytest.mark.parametrize("window", [1, 4])
def test_window_is_transformers_rule(window):
    """The window mask is transformers' rule (test_hf_window.py calls transformers' own function), and
    the 'xla' kernel's output is torch_ref's (an independent implementation) at 1e-5, at a decode offset."""
    t, off = 9, 3
    assert np.array_equal(np.asarray(kernels.causal_mask(t, t + off, off, window=window)), window_rule(t, off, window))
    q, k, v = _qkv(2, t, t + off, 4, 2)
    out = sdpa(q, k, v, is_causal=True, q_offset=off, window=window)
    ref = torch_sdpa(*(torch.tensor(np.asarray(a)) for a in (q, k, v)), is_causal=True, q_offset=off,
                     window=window)
    assert_close(out, ref.numpy(), f"sdpa window={window} vs torch_ref")


def _out_and_grads(fn, qkv, window=None):
    """fn's output and q/k/v gradients in one jit; ``window`` (if given) passed traced."""
    w = jnp.asarray(np.random.default_rng(3).standard_normal(qkv[0].shape), jnp.float32)

    def f(q, k, v, window):
        out, vjp = jax.vjp(lambda *a: fn(*a) if window is None else fn(*a, window=window), q, k, v)
        return out, vjp(w)

    return jax.jit(f)(*qkv, window)


# (Tq, Tk, q_offset): a training forward over several 8-key blocks, and a 3-query chunk after 20 cached positions
SHAPES = {"forward": (29, 29, 0), "chunk": (3, 30, 20)}


@pytest.mark.parametrize("impl", ["jax", "blocked", "auto"])
def test_kernels_match_xla_with_a_window(impl):
    """Each kernel against 'xla', forward and q/k/v gradients at 1e-5, with the window static
    (jax.nn's local_window_size where it takes it) and traced (a scanned layer's), window 5 (inside
    one block) and 10 (across blocks; the last query to see a key block opens a query block, the
    edge of the backward's block skipping); 'blocked' skips the key blocks wholly before the window."""
    for shape, window in [("forward", 5), ("forward", 10), ("chunk", 5)]:
        tq, tk, off = SHAPES[shape]
        qkv = _qkv(2, tq, tk, 4, 2)
        kw = dict(is_causal=True, q_offset=off, block=8)
        ref = _out_and_grads(functools.partial(attend, impl="xla", window=window, **kw), qkv)
        for traced in (False, True):
            fn = functools.partial(attend, impl=impl, **kw)
            out, grads = _out_and_grads(fn, qkv, jnp.int32(window)) if traced else \
                _out_and_grads(functools.partial(fn, window=window), qkv)
            name = f"attention[{impl}] {shape} window={window}{' traced' if traced else ''} vs xla"
            assert_close(out, ref[0], name)
            assert_grads_close(dict(zip("qkv", grads)), dict(zip("qkv", ref[1])), name + " grads")


def test_cpu_cache_kernels_take_the_window():
    """The C++ cache kernel (generate's decode) and the C++ PagedAttention kernel (the engine) against
    'xla' over the same keys, with a traced window: they start reading at the window's first key."""
    if not paged_ffi.available():
        pytest.skip("the C++ kernels are not built here")
    q, _, _ = _qkv(2, 3, 3, 4, 2)
    k, v = (jnp.asarray(np.random.default_rng(s).standard_normal((2, 2, 24, 8)), jnp.float32) for s in (5, 6))
    pool_k, pool_v = (jnp.asarray(np.random.default_rng(s).standard_normal((16, 2, 4, 8)), jnp.float32) for s in (7, 8))
    table = jnp.asarray([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], jnp.int32)
    q_pos = jnp.asarray([[13, 14, 15], [20, 21, -1]], jnp.int32)
    for window in (1, 4, 9):
        got = jax.jit(lambda q, k, v, w: paged_ffi.cached_attention(q, k, v, jnp.int32(13), window=w))(
            q, k, v, jnp.int32(window))
        want = sdpa(q, k, v, is_causal=True, q_offset=13, kv_layout="heads", window=window)
        assert_close(got, want, f"cached_attention window={window} vs xla")
        got = jax.jit(lambda q, w: paged_ffi.paged_attention(q, pool_k, pool_v, table, q_pos, window=w))(
            q, jnp.int32(window))
        rows_k, rows_v, mask = paged.gather(pool_k, pool_v, table, q_pos)  # written and causal, no window
        pos = jnp.arange(rows_k.shape[1])[None, None, None, :]
        mask = mask & (pos > q_pos[:, None, :, None] - window)  # the window, written out here
        assert_close(got, sdpa(q, rows_k, rows_v, mask=mask, kv_layout="rows"), f"paged_attention window={window}")
        gathered = attend(q, pool_k, pool_v, kv_layout="pages", pages=(table, q_pos), window=window, return_weights=True)
        assert_close(gathered[0], got, f"paged gather path window={window} vs the C++ kernel")


def test_the_cpu_training_kernel_takes_a_static_window(monkeypatch):
    """attention_impl='ffi' (the C++ causal training kernel) against 'xla' with a static window,
    forward and gradients at 1e-5, alone and with packed documents; 'auto' runs it for a static window.
    A traced window (scanned layers mixing kinds) it cannot take: 'ffi' refuses it in one line, 'auto'
    runs a portable kernel (the C++ kernel is never called) with 'xla''s numbers."""
    if not causal_ffi.available():
        pytest.skip("the C++ kernels are not built here")
    qkv = _qkv(2, 29, 29, 4, 2)
    seg = jnp.asarray(np.repeat([0, 1, 2], 10)[None, :29].repeat(2, 0), jnp.int32)
    for segments in (None, seg):
        kw = dict(is_causal=True, segment_ids=segments)
        want = _out_and_grads(functools.partial(attend, impl="xla", window=10, **kw), qkv)
        got = _out_and_grads(functools.partial(attend, impl="ffi", window=10, **kw), qkv)
        name = f"attention[ffi] window=10{' segments' if segments is not None else ''} vs xla"
        assert_close(got[0], want[0], name)
        assert_grads_close(dict(zip("qkv", got[1])), dict(zip("qkv", want[1])), name + " grads")
    q, k, v = qkv
    with pytest.raises(ValueError, match="attention_impl='ffi' .* takes a static sliding window, not a traced one"):
        jax.jit(lambda q, k, v, w: attend(q, k, v, impl="ffi", is_causal=True, window=w))(q, k, v, jnp.int32(4))
    with pytest.raises(ValueError, match="sliding window narrows causal attention"):
        attend(q, k, v, impl="xla", window=4)
    calls = []
    real = causal_ffi.causal_attention
    monkeypatch.setattr(causal_ffi, "causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attend(q, k, v, impl="auto", is_causal=True, window=4)
    assert calls == [1]
    got = jax.jit(lambda q, k, v, w: attend(q, k, v, impl="auto", is_causal=True, window=w))(q, k, v, jnp.int32(4))
    assert calls == [1]
    assert_close(got, sdpa(q, k, v, is_causal=True, window=4), "attention[auto] traced window=4 vs xla")


def test_config_rules():
    cfg = ModelConfig(n_layer=4, sliding_window=8, window_layers=[3, 1])
    assert cfg.window_layers == (1, 3) and [cfg.layer_window(i) for i in range(4)] == [None, 8, None, 8]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig(sliding_window=8).layer_window(0) == 8
    from jaxgpt.config import BertConfig, EncDecConfig

    with pytest.raises(ValueError, match="BERT attends both ways"):
        BertConfig(encoder=ModelConfig(sliding_window=4))
    with pytest.raises(ValueError, match="the encoder attends both ways"):
        EncDecConfig(encoder=ModelConfig(sliding_window=4), decoder=ModelConfig())
    for bad, match in [(dict(window_layers=(0,)), "needs a sliding_window"), (dict(sliding_window=0), "positive"),
                       (dict(sliding_window=4, window_layers=(4,)), r"in \[0, n_layer=4\)"),
                       (dict(sliding_window=4, residual="full_attnres"), "needs residual='standard'")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(n_layer=4, **bad)


BASE = PRESETS["llama-tiny"].replace(vocab_size=48, d_model=32, n_head=4, n_layer=3, max_len=32, n_kv_head=2, d_ff=48)
MODELS = {
    "all-slide": BASE.replace(sliding_window=3),  # one static window in the scanned body
    "mixed-scanned": BASE.replace(sliding_window=3, window_layers=(0, 2)),  # the windows scanned (traced)
    "mixed-layers": BASE.replace(sliding_window=4, window_layers=(1,)),  # a window per layer (separate layers)
    # Gemma 3: the sliding layers' own RoPE base (selected per scanned layer, or static per layer), (1 + w) q/k norms
    "local-base-scanned": BASE.replace(sliding_window=3, window_layers=(0, 2), rope_local_base=100.0, qk_norm="head",
                                       norm_unit_offset=True),
    "local-base-layers": BASE.replace(sliding_window=3, window_layers=(1,), rope_local_base=100.0,
                                      rope_scaling=RopeScaling("linear", factor=2.0)),
}
EXECUTIONS = {name: Execution(scan_layers=not name.endswith("-layers")) for name in MODELS}


def _model(name):
    cfg, ex = MODELS[name], EXECUTIONS[name]
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    p = random_params(build(cfg, ex), tok[:1, :1], seed=0)
    return name, cfg, p, load_into(tbuild(cfg), p, ("layers",) if ex.scan_layers else ()), tok


def _torch_loss(t, x, y):
    logits = t(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(y).long().flatten())
    loss.backward()
    return logits, loss


@pytest.mark.parametrize("name", ["all-slide", "mixed-scanned", "local-base-scanned", "local-base-layers"])
def test_decoder_matches_torch_ref(name):
    """Logits, loss and every parameter's gradient against torch_ref (float32 at 1e-5, and float64 as
    in test_decoder.py) over 12 positions, four times the window."""
    name, cfg, p, t, tok = _model(name)
    ex = EXECUTIONS[name]
    stacked = ("layers",) if ex.scan_layers else ()
    x, y = tok[:, :-1], tok[:, 1:]

    def loss(p):
        logits = build(cfg, ex).apply({"params": p}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))

    value, grads = jax.value_and_grad(loss)(p)
    t64 = float64_module(t)
    tlogits, tloss = _torch_loss(t, x, y)
    with float64_torch():
        tlogits64, tloss64 = _torch_loss(t64, x, y)
    assert_as_accurate_as_torch(build(cfg, ex).apply({"params": p}, x), tlogits, tlogits64, f"window {name} logits",
                                direct=False)
    assert_as_accurate_as_torch(value, tloss, tloss64, f"window {name} loss")
    assert_as_accurate_as_torch(grads, torch_grads(t, p, stacked), torch_grads(t64, p, stacked, np.float64),
                                f"window {name} grads", grads=True)


def test_greedy_decoding_past_the_window():
    """Separate layers, one sliding among global ones: the logits match torch_ref's, and a 7-token
    prompt (longer than the window) decoded 12 tokens with generate's KV cache gives torch_ref's greedy
    tokens (the engine's paged cache: test_hf_window.py)."""
    name, cfg, p, t, tok = _model("mixed-layers")
    ex = EXECUTIONS[name]
    assert_close(build(cfg, ex).apply({"params": p}, tok), t(torch.from_numpy(tok)).detach().numpy(),
                 f"window {name} logits", unit_scale=True)
    prompt = tok[:, :7]
    assert np.array_equal(np.asarray(generate(cfg, p, prompt, 12, execution=ex)), tgenerate(t, torch.from_numpy(prompt), 12).numpy())


def test_engine_pages_stay_bounded_by_the_window():
    """Every layer slides (window 8, pages of 4): three requests decode 28 tokens past a 5-token prompt,
    sharing 12 pages where each alone would need 9 without the window (prefix caching on, the default). The pages they hold never pass
    ceil(7 / 4) + 1 + 1 = 4 each (the window's keys, the page being written, one of headroom), nothing is
    preempted, and the tokens are torch_ref's greedy tokens (decoded with a KV cache masked by position)."""
    from jaxgpt.inference.engine import Engine
    from jaxgpt.inference.sampling import SamplingParams

    cfg = BASE.replace(sliding_window=8, n_layer=2, max_len=64)
    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 5))
    p = random_params(build(cfg), prompts[:1, :1], seed=1)
    want = tgenerate(load_into(tbuild(cfg), p, ("layers",)), torch.from_numpy(prompts), 28).numpy()[:, 5:]
    eng = Engine(cfg, p, page_size=4, num_pages=13, max_seqs=3, max_tokens_per_step=16, max_model_len=48,
                 enable_prefix_caching=True)  # released pages stay cached: the harder case
    ids = [eng.add_request(list(x), SamplingParams(max_tokens=28)) for x in prompts]
    out, held = {i: [] for i in ids}, []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.id] += o.new_token_ids
        held.append(max([sum(1 for pg in r.pages if pg) for r in eng.running] or [0]))
    assert max(held) <= 4 and eng.stats["preemptions"] == 0, (held, eng.stats)
    assert [out[i] for i in ids] == want.tolist()
    # so a request needs pages for its window and one step's tokens, not for its whole context:
    # ceil((8 - 1 + 16) / 4) + 1 = 7 pages by default, not 12, and a pool of 7 serves all three
    kw = dict(page_size=4, max_seqs=3, max_tokens_per_step=16, max_model_len=48)
    assert Engine(cfg, p, **kw).allocator.total == 3 * 7
    assert Engine(cfg.replace(sliding_window=None), p, **kw).allocator.total == 3 * 12
    small = Engine(cfg, p, num_pages=8, **kw)  # 7 pages for three requests: they wait or are preempted, tokens exact
    assert small.generate([list(x) for x in prompts], SamplingParams(max_tokens=16)) == want[:, :16].tolist()
    with pytest.raises(ValueError, match="num_pages=7 cannot hold one full context .* a sliding window"):
        Engine(cfg, p, num_pages=7, **kw)
