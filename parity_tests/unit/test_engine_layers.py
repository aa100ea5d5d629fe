"""Engine knobs of the layer stack (``scan_layers``, ``scan_unroll``, ``remat``, ``norm_impl``): they change how the
stack compiles, never the numbers. Parity against torch_ref for each setting (forward and
gradients, 1e-5), self-consistency against the default layout (<= 1e-6 of scale), cached generation,
conversion of both parameter layouts, and structural checks that each knob takes effect (the
lowered program's loops, the remat policy in the jaxpr, XLA's temporary memory)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import (assert_as_accurate_as_torch, assert_close, assert_grads_close, assert_self_consistent,
                      float64_module, float64_torch, load_into, randomize, require_module, torch_grads)
from jaxgpt import PRESETS, build
from jaxgpt.config import REMATS, EncDecConfig, Execution
from jaxgpt.convert import (from_hf, load_safetensors, params_to_state_dict, save_safetensors, state_dict_to_params,
                            to_hf)
from jaxgpt.inference.generate import generate
from jaxgpt.models import abstract_params, init_cache, stacked_paths
from jaxgpt.nn.kernels import norm_ffi
from torch_ref import build as tbuild

TINY = dict(vocab_size=48, d_model=32, n_head=4, n_layer=3, max_len=32)
BASE = PRESETS["llama-tiny"].replace(**TINY, n_kv_head=2, d_ff=48)  # RoPE + GQA: the cache path has most parts
SETTINGS = {  # against the default: scan_unroll='auto' (fully unrolled on the CPU)
    "rolled": dict(scan_unroll=1),
    "unrolled": dict(scan_unroll=3),
    "unroll-2": dict(scan_unroll=2),  # 3 layers: one 2-layer iteration + a remainder
    "no-scan": dict(scan_layers=False),
    "remat-full": dict(remat="full"),
    "remat-dots": dict(remat="dots_saveable"),
    "no-scan-remat": dict(scan_layers=False, remat="dots_with_no_batch_dims_saveable"),
    "norm-ffi": dict(norm_impl="ffi"),  # the C++ RMSNorm ('auto' runs it on train-step-sized inputs only)
}
SELF_TOL = 1e-6
KERNEL_SETTINGS = ("norm-ffi",)  # a C++ kernel instead of XLA's op: judged against float64, not the default path


def _tokens(cfg, b=2, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)


DEFAULT = Execution()


def relayout(params, src: Execution, dst: Execution, cfg=BASE):
    """Params of ``cfg`` in ``src``'s layout -> ``dst``'s, through the torch_ref state dict (the converters' rule)."""
    return state_dict_to_params(params_to_state_dict(params, stacked=stacked_paths(cfg, src)), abstract_params(cfg, dst),
                                stacked=stacked_paths(cfg, dst))


def _base_params(seed=0):
    return randomize(abstract_params(BASE), seed)


def _value_and_grads(ex, p, x, y):
    def loss(p):
        logits = build(BASE, ex).apply({"params": p}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
    return value, logits, grads


@functools.cache
def _default_reference():
    """Logits and gradients of the default layout (scanned, rolled, no remat), computed once."""
    tok = _tokens(BASE)
    _, logits, grads = _value_and_grads(DEFAULT, _base_params(), tok[:, :-1], tok[:, 1:])
    return logits, grads


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_matches_torch_ref_and_the_default_layout(name):
    """Parity: logits and next-token cross-entropy gradients vs torch_ref (which ignores the knobs), 1e-5.
    Self-consistency: the same weights give the same logits and gradients as the default layout, to 1e-6
    of their scale (XLA fuses a scanned body and separate layers differently; logits reach ~5)."""
    if name in KERNEL_SETTINGS and not norm_ffi.available():
        pytest.skip("no C++ compiler, or JAXGPT_KERNELS=off: the norm kernel cannot run")
    ex = Execution(**SETTINGS[name])
    p = relayout(_base_params(), DEFAULT, ex)
    t = load_into(tbuild(BASE), p, stacked_paths(BASE, ex))  # torch_ref has no Execution
    tok = _tokens(BASE)
    x, y = tok[:, :-1], tok[:, 1:]
    _, logits, grads = _value_and_grads(ex, p, x, y)
    tlogits = t(torch.from_numpy(x))
    assert_close(logits, tlogits, f"DecoderLM engine knobs ({name}) logits")
    torch.nn.functional.cross_entropy(tlogits.flatten(0, 1), torch.from_numpy(y).long().flatten()).backward()
    assert_grads_close(grads, torch_grads(t, p, stacked_paths(BASE, ex)), f"DecoderLM engine knobs ({name}) grads")

    ref_logits, ref_grads = _default_reference()
    if name in KERNEL_SETTINGS:
        # A kernel sums in its own order: against the default float32 path the gradients differ by rounding
        # alone (1.3e-6 on an AVX2 CPU, <= 1e-6 on AVX-512), so the judge is float64 torch_ref, as for every
        # parity row: as accurate as torch_ref float32 is (conftest.assert_as_accurate_as_torch)
        t64 = float64_module(t)
        with float64_torch():
            tlogits64 = t64(torch.from_numpy(x))
            torch.nn.functional.cross_entropy(tlogits64.flatten(0, 1), torch.from_numpy(y).long().flatten()).backward()
        assert_as_accurate_as_torch(logits, tlogits, tlogits64, f"engine knobs ({name}) logits", direct=False)
        assert_as_accurate_as_torch(grads, torch_grads(t, p, stacked_paths(BASE, ex)),
                                    torch_grads(t64, p, stacked_paths(BASE, ex), np.float64),
                                    f"engine knobs ({name}) grads", grads=True, direct=False)
        return
    assert_self_consistent(logits, ref_logits, f"engine knobs ({name}) vs default: logits", SELF_TOL, unit_scale=True)
    assert_grads_close(relayout(grads, ex, DEFAULT), ref_grads, f"engine knobs ({name}) vs default: grads", SELF_TOL,
                       kind="self")


@functools.cache
def _default_generation(prompt_seed=1):
    prompt = _tokens(BASE, 2, 5, seed=prompt_seed)
    ref = build(BASE).apply({"params": _base_params()}, prompt, cache=init_cache(BASE, 2, 16))
    return prompt, ref.cache.k, np.asarray(generate(BASE, _base_params(), prompt, 8))


@pytest.mark.parametrize("name", ["no-scan", "unrolled"])
def test_cached_generation_in_each_layout(name):
    """One stacked cache layout (L, B, H_kv, S, D) for every setting (indexed per layer without a scan);
    prefill K/V and greedy tokens as the default's (remat does not touch a forward pass)."""
    cfg, ex = BASE, Execution(**SETTINGS[name])
    p = relayout(_base_params(), DEFAULT, ex)
    prompt, ref_k, ref_tokens = _default_generation()
    out = build(cfg, ex).apply({"params": p}, prompt, cache=init_cache(cfg, 2, 16))
    assert out.cache.k.shape == (cfg.n_layer, 2, cfg.kv_heads, 16, cfg.head_dim)
    assert np.array_equal(np.asarray(out.cache.index), [5] * cfg.n_layer)
    # K reaches ~3 here: 1e-6 of its scale, as the logits above (no-scan measured 4.8e-7)
    assert_self_consistent(out.cache.k, ref_k, f"engine knobs ({name}) vs default: KV cache", SELF_TOL, unit_scale=True)
    assert np.array_equal(np.asarray(generate(cfg, p, prompt, 8, execution=ex)), ref_tokens)


def test_bert_and_encdec_without_scan_match_torch_ref():
    """BERT and the encoder-decoder build their stacks with the same code: separate layers_{i} there too
    (forward vs torch_ref; the gradients through such stacks are checked on the decoder above)."""
    bert = PRESETS["bert-base"]
    bert = bert.replace(encoder=bert.encoder.replace(**{**TINY, "n_layer": 2}, d_ff=64, dropout=0.0,
                                                      attn_dropout=0.0))
    ex = Execution(scan_layers=False, remat="full")
    ids = _tokens(bert.encoder, 2, 7)
    mask = np.ones((2, 7), bool)
    mask[1, 4:] = False
    assert stacked_paths(bert, ex) == ()
    p = randomize(abstract_params(bert, ex))
    assert {"layers_0", "layers_1"} <= set(p) and "layers" not in p
    t = load_into(tbuild(bert), p, stacked_paths(bert, ex)).eval()
    assert_close(jax.jit(build(bert, ex).apply)({"params": p}, ids, mask), t(torch.from_numpy(ids), torch.from_numpy(mask)),
                 "Bert scan_layers=False forward")

    enc = PRESETS["seed-transformer"].encoder.replace(vocab_size=40, d_model=32, n_layer=2, d_ff=64, max_len=16)
    encdec = EncDecConfig(enc, enc.replace(vocab_size=30))
    ex = Execution(scan_layers=False)
    assert stacked_paths(encdec, ex) == () and stacked_paths(encdec) == ("encoder/layers", "decoder/layers")
    src, tgt = _tokens(enc, 2, 9), _tokens(encdec.decoder, 2, 7)
    p = randomize(abstract_params(encdec, ex))
    t = load_into(tbuild(encdec), p, stacked_paths(encdec, ex)).eval()
    assert_close(jax.jit(build(encdec, ex).apply)({"params": p}, src, tgt), t(torch.from_numpy(src), torch.from_numpy(tgt)),
                 "EncDec scan_layers=False forward")


def test_both_layouts_convert_to_the_same_state_dict(tmp_path):
    """Scanned (L, ...) and separate layers_{i} params give the same torch_ref state dict, key for key and bit
    for bit, and come back from it exactly; torch_ref loads it strictly either way."""
    flat = Execution(scan_layers=False)
    p = _base_params()
    q = relayout(p, DEFAULT, flat)
    assert "layers" in p and "layers" not in q and "layers_2" in q
    sd_scan, sd_flat = params_to_state_dict(p, stacked=("layers",)), params_to_state_dict(q, stacked=())
    assert sorted(sd_scan) == sorted(sd_flat) == sorted(tbuild(BASE).state_dict())
    assert all(np.array_equal(sd_scan[k], sd_flat[k]) for k in sd_scan)
    back = state_dict_to_params(sd_flat, abstract_params(BASE, flat), stacked=stacked_paths(BASE, flat))
    assert jax.tree.all(jax.tree.map(np.array_equal, back, jax.device_get(q)))
    assert np.array_equal(np.asarray(q["layers_1"]["attn"]["q_proj"]["kernel"]),
                          np.asarray(p["layers"]["attn"]["q_proj"]["kernel"][1]))
    save_safetensors(tmp_path / "m.safetensors", q, BASE)  # jaxgpt's own files: loaded in the default layout
    config2, p2 = load_safetensors(tmp_path / "m.safetensors")
    assert config2 == BASE and jax.tree.all(jax.tree.map(np.array_equal, p2, jax.device_get(p)))


def test_hf_round_trip_without_scan():
    """to_hf accepts separate-layer params (scan_layers=False: the knobs have no HF counterpart and need
    none) and from_hf gives back the same weights (in the default layout), bit for bit."""
    require_module("transformers")
    cfg = PRESETS["gpt2-small"].replace(**TINY, dropout=0.0, attn_dropout=0.0)
    ex = Execution(scan_layers=False, remat="full", scan_unroll=2)
    p = randomize(abstract_params(cfg, ex))
    config2, p2 = from_hf(to_hf(cfg, p))
    assert config2 == cfg.replace(d_ff=cfg.ffn_dim)
    back = relayout(p2, DEFAULT, ex, config2)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, jax.device_get(p)))


def test_unroll_and_scan_layers_change_the_lowered_loop():
    """The knobs reach the compiler: a while loop only for a scanned, not fully unrolled stack."""
    tok = _tokens(BASE, 1, 8)
    p0 = _base_params()
    loops = {}
    kernels = norm_ffi.available()
    for name, kw in {"default": {}, **SETTINGS}.items():
        if name in KERNEL_SETTINGS and not kernels:
            continue  # norm_impl='ffi' is refused where the kernel cannot run
        ex = Execution(**kw)
        text = jax.jit(lambda p, t, ex=ex: build(BASE, ex).apply({"params": p}, t)).lower(relayout(p0, DEFAULT, ex),
                                                                                         tok).as_text()
        loops[name] = text.count("stablehlo.while")
    auto = 0 if jax.default_backend() in ("cpu", "gpu") else 1  # scan_unroll='auto': fully unrolled on the CPU and GPU
    want = {"default": auto, "rolled": 1, "unrolled": 0, "unroll-2": 1, "no-scan": 0, "remat-full": 1,
            "remat-dots": 1, "no-scan-remat": 0, "norm-ffi": auto}  # 'auto' with remat: rolled, which keeps its saving
    if not kernels:
        del want["norm-ffi"]
    assert loops == want


def test_init_params_are_the_unrolled_modules_init():
    """init_params initialises a scanned stack rolled (it compiles faster); self-consistency, exact:
    the values are those of the unrolled module's own init."""
    from jaxgpt.models import init_params

    ex = Execution(scan_unroll=3)
    key = jax.random.PRNGKey(3)
    want = jax.jit(lambda k: build(BASE, ex).init(k, jnp.zeros((1, 1), jnp.int32))["params"])(key)
    got = jax.jit(init_params, static_argnums=(0, 2))(BASE, key, ex)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow  # five compiled programs, ~9 s: make test-slow
def test_remat_policies_reach_the_program_and_save_memory():
    """Each policy is the one in the jaxpr, and XLA's temporary memory for the gradient shrinks from none
    (every activation kept) through the dots policies to full (recompute everything)."""
    # 'xla' attention: its score and mix einsums are the batched dots the two dots policies tell apart
    # (the CPU default, the C++ kernel, is one custom call that neither policy saves)
    cfg0 = BASE.replace(n_layer=2, max_len=32)
    tok = _tokens(cfg0, 2, 32)
    p = randomize(abstract_params(cfg0))
    temp, policy = {}, {}
    for remat in REMATS:
        ex = Execution(attention_impl="xla", remat=remat)

        def f(p, ex=ex):
            return build(cfg0, ex).apply({"params": p}, tok).sum()

        jaxpr = str(jax.make_jaxpr(jax.grad(f))(p))
        policy[remat] = re.findall(r"policy=(\w+\([^)]*\)|None)", jaxpr)[:1]
        temp[remat] = jax.jit(jax.grad(f)).lower(p).compile().memory_analysis().temp_size_in_bytes
    assert policy == {"none": [], "full": ["None"], "dots_saveable": ["DotsSaveable(only_if_no_batch_dims=False)"],
                      "dots_with_no_batch_dims_saveable": ["DotsSaveable(only_if_no_batch_dims=True)"]}
    assert temp["full"] < temp["dots_with_no_batch_dims_saveable"] < temp["dots_saveable"] < temp["none"], temp


@pytest.mark.parametrize("kw,message", [
    (dict(scan_unroll=0), r"scan_unroll must be a positive int, got 0"),
    (dict(remat="offload"), r"remat='offload' is not one of \('none', 'full', 'dots_saveable', "),
    (dict(residual="full_attnres", remat="full"), r"residual='full_attnres' layers are not scanned or rematerialised"),
    (dict(scan_layers=1), r"scan_layers must be a bool, got 1"),
])
def test_bad_knob_values_are_refused(kw, message):
    arch = {k: kw.pop(k) for k in ("residual",) if k in kw}
    with pytest.raises(ValueError, match=message):
        build(BASE.replace(**arch), Execution(**kw))
