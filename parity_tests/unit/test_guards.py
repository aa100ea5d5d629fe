"""Guards (issue #8 items 2, 3 and masks): what JAX would do silently is an error, eagerly and in
checked mode (jaxgpt.nn.checks, checkify) under jit, with the same message as torch_ref.

- A KV cache written past its capacity (dynamic_update_slice clamps the start: old slots are
  overwritten) through Attention and DecoderLM.
- Token ids outside the vocabulary (a gather clamps -1 to vocab-1; ids >= vocab give NaN logits),
  targets outside [0, vocab) other than the ignore index, class labels outside [0, n_classes):
  through the model, generate, cross_entropy, check_batch, tasks, the train loop and eval.
- Masks of a wrong dtype or shape; a fully masked row is zeros with zero gradients in both
  frameworks (self-attention with key padding, cross-attention), at the suite's 1e-5.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from conftest import check_module
from jaxgpt import build
from jaxgpt.nn.attention import Attention, KVCache, scaled_dot_product_attention as sdpa
from jaxgpt.nn import checks
from jaxgpt.nn.checks import checked
from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig, TrainConfig
from jaxgpt.data import IGNORE_INDEX
from jaxgpt.inference.generate import generate, generate_seq2seq
from jaxgpt.models import init_params
from jaxgpt.models.decoder import init_cache
from jaxgpt.train import cross_entropy, init_state, make_train_step
from jaxgpt.train.loop import evaluate, fit
from jaxgpt.train.step import make_eval_step
from jaxgpt.data.tasks import fit_config, load_task
from jaxgpt.core.validate import check_batch
from torch_ref.nn import attention as tattn
from torch_ref.convert import load_params
from torch_ref.generate import generate as tgenerate
from torch_ref.models.decoder import init_cache as tinit_cache

CFG = ModelConfig(vocab_size=20, d_model=16, n_layer=2, n_head=2, n_kv_head=1, max_len=16, pos="rope")
OVERFLOW = r"KV cache overflow: 3 cached \+ 2 new > capacity 4"


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def tmodel(params):
    return load_params(torch_ref.build(CFG), jax.device_get(params)).eval()


# 1. KV cache overflow ---------------------------------------------------------------------------
def _attention():
    a = Attention(d_model=8, n_head=2)
    return a, a.init(jax.random.PRNGKey(0), jnp.ones((1, 3, 8)))["params"]


def test_attention_cache_overflow_eager_jit_checked_and_torch():
    a, p = _attention()
    write = lambda c, x: a.apply({"params": p}, x, is_causal=True, cache=c)[1]
    cache = write(KVCache.init(1, 2, 4, 4), jnp.ones((1, 3, 8)))
    with pytest.raises(ValueError, match=OVERFLOW):
        write(cache, jnp.ones((1, 2, 8)))  # eager: the index is concrete
    assert int(jax.jit(write)(cache, jnp.ones((1, 2, 8))).index) == 5  # plain jit: nothing can raise
    with pytest.raises(ValueError, match=OVERFLOW):
        checked(write)(cache, jnp.ones((1, 2, 8)))
    assert int(checked(write)(cache, jnp.ones((1, 1, 8))).index) == 4  # filling it exactly is fine
    ta, tcache = tattn.Attention(8, 2), tattn.KVCache.init(1, 2, 4, 4)
    _, tcache, _ = ta(torch.ones(1, 3, 8), is_causal=True, cache=tcache)
    with pytest.raises(ValueError, match=OVERFLOW):
        ta(torch.ones(1, 2, 8), is_causal=True, cache=tcache)


def test_decoder_cache_overflow_eager_checked_and_torch(params, tmodel):
    m, tok = build(CFG), jnp.ones((1, 3), jnp.int32)
    cache = m.apply({"params": params}, tok, cache=init_cache(CFG, 1, 4)).cache
    step = lambda c, t: m.apply({"params": params}, t, cache=c).cache
    with pytest.raises(ValueError, match=OVERFLOW):
        step(cache, tok[:, :2])
    with pytest.raises(ValueError, match=OVERFLOW):
        checked(step)(cache, tok[:, :2])  # the index is traced: the checkify check catches it
    assert checked(step)(cache, tok[:, :1]).index.tolist() == [4, 4]
    tcache = tmodel(torch.ones(1, 3, dtype=torch.long), cache=tinit_cache(CFG, 1, 4)).cache
    with pytest.raises(ValueError, match=OVERFLOW):
        tmodel(torch.ones(1, 2, dtype=torch.long), cache=tcache)


# 2. Token ids -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,pos", [(-1, (0, 1)), (20, (1, 0))])
def test_bad_token_ids_eager_checked_and_torch(params, tmodel, bad, pos):
    tokens = np.array([[1, 2], [3, 4]], np.int32)
    tokens[pos] = bad
    msg = rf"token id {bad} is outside the vocabulary \[0, 20\) at position \({pos[0]}, {pos[1]}\)"
    forward = lambda p, t: build(CFG).apply({"params": p}, t)
    with pytest.raises(ValueError, match=msg):
        forward(params, tokens)
    with pytest.raises(ValueError, match=msg):
        checked(forward)(params, jnp.asarray(tokens))
    with pytest.raises(ValueError, match=msg):
        tmodel(torch.from_numpy(tokens).long())
    good = np.array([[1, 2], [3, 19]], np.int32)
    np.testing.assert_array_equal(checked(forward)(params, good), jax.jit(forward)(params, good))


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_rejects_bad_prompt_ids(params, tmodel, use_cache):
    for bad in (-1, 20):
        prompt = np.array([[1, 2, 3], [4, bad, 6]], np.int32)
        msg = rf"token id {bad} is outside the vocabulary \[0, 20\) at position \(1, 1\)"
        with pytest.raises(ValueError, match=msg):
            generate(CFG, params, prompt, 3, use_cache=use_cache)
        with pytest.raises(ValueError, match=msg):
            tgenerate(tmodel, torch.from_numpy(prompt).long(), 3, use_cache=use_cache)
    for kw, msg in [(dict(eos_id=20), r"eos_id 20 is outside the vocabulary \[0, 20\)"), (dict(max_new_tokens=0),
                    "max_new_tokens must be >= 1"), (dict(prompt=np.zeros((1, 0), np.int32)), "prompt must be")]:
        args = {"prompt": np.ones((1, 2), np.int32), "max_new_tokens": 3, **kw}
        with pytest.raises(ValueError, match=msg):
            generate(CFG, params, use_cache=use_cache, **args)
        with pytest.raises(ValueError, match=msg):
            tgenerate(tmodel, torch.from_numpy(args.pop("prompt")).long(), use_cache=use_cache, **args)


def test_generate_seq2seq_rejects_float_masks_and_bad_special_ids():
    enc = ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_len=8)
    ed, src = EncDecConfig(enc, enc.replace(vocab_size=10)), np.ones((2, 4), np.int32)
    ok = np.ones((2, 4), bool)
    for mask, kw, msg in [(np.zeros((2, 4), np.float32), {}, r"src_mask must be bool or 0/1 integers"),
                          (np.ones((2, 5), bool), {}, r"src_mask has shape \(2, 5\), expected \(2, 4\)"),
                          (ok, dict(bos_id=10), r"bos_id 10 is outside the decoder vocabulary \[0, 10\)"),
                          (ok, dict(eos_id=-1), r"eos_id -1 is outside the decoder vocabulary")]:
        with pytest.raises(ValueError, match=msg):  # checked before any compilation: params unused
            generate_seq2seq(ed, None, src, mask, 3, **{"bos_id": 1, **kw})


# 3. Targets and labels --------------------------------------------------------------------------
def test_cross_entropy_targets_eager_and_checked():
    logits = np.zeros((2, 3, 5), np.float32)
    ok = np.array([[0, 4, IGNORE_INDEX], [1, 2, 3]])
    assert int(cross_entropy(logits, ok)[1]) == 5
    ce = lambda lg, t: cross_entropy(lg, t)[0]
    for bad in (-1, 5):
        t = ok.copy()
        t[1, 2] = bad
        msg = rf"target {bad} is outside \[0, 5\) and is not the ignore index -100 at position \(1, 2\)"
        with pytest.raises(ValueError, match=msg):
            cross_entropy(logits, t)
        with pytest.raises(ValueError, match=msg):
            checked(ce)(logits, t)
        jax.jit(ce)(logits, t)  # plain jit: scored silently (-1 as class 4), which is why checks exist


def _lm_batch():
    return {"x": np.array([[1, 2, 3]]), "y": np.array([[2, 3, IGNORE_INDEX]])}


def test_check_batch_names_key_position_and_limit():
    assert check_batch(_lm_batch(), CFG)["x"].shape == (1, 3)
    cases = [("x", (0, 1), -1, r"batch\['x'\]: token id -1 is outside the vocabulary \[0, 20\) at position \(0, 1\)"),
             ("y", (0, 0), 20, r"batch\['y'\]: target 20 is outside \[0, 20\) and is not the ignore index"),
             ("y", (0, 2), -1, r"batch\['y'\]: target -1 is outside .* at position \(0, 2\)")]
    for key, pos, value, msg in cases:
        b = _lm_batch()
        b[key][pos] = value
        with pytest.raises(ValueError, match=msg):
            check_batch(b, CFG)
    with pytest.raises(ValueError, match=r"batch lacks \['y'\]"):
        check_batch({"x": np.zeros((1, 3), np.int32)}, CFG)
    with pytest.raises(ValueError, match=r"batch\['x'\]: token ids must be integers, got dtype float32"):
        check_batch({"x": np.zeros((1, 3), np.float32), "y": np.zeros((1, 3), np.int32)}, CFG)

    bert = BertConfig(ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_len=8), n_classes=3)
    b = {"input_ids": np.ones((2, 4), np.int32), "attention_mask": np.ones((2, 4), bool), "labels": np.array([0, 2])}
    check_batch(b, bert)
    with pytest.raises(ValueError, match=r"batch\['labels'\]: label 3 is outside the classes \[0, 3\) at "
                                         r"position \(1,\)"):
        check_batch({**b, "labels": np.array([0, 3])}, bert)
    with pytest.raises(ValueError, match=r"batch\['labels'\]: label -100 is outside the classes"):
        check_batch({**b, "labels": np.array([-100, 0])}, bert)  # no ignore index for class labels
    with pytest.raises(ValueError, match=r"batch\['attention_mask'\] must be bool or 0/1 integers .* float32"):
        check_batch({**b, "attention_mask": np.ones((2, 4), np.float32)}, bert)
    with pytest.raises(ValueError, match=r"batch\['attention_mask'\] has shape \(2, 5\), expected \(2, 4\)"):
        check_batch({**b, "attention_mask": np.ones((2, 5), bool)}, bert)

    enc = ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_len=8)
    ed = EncDecConfig(enc, enc.replace(vocab_size=10))
    b = {"src": np.ones((1, 4), np.int32), "tgt": np.ones((1, 3), np.int32), "src_mask": np.ones((1, 4), bool),
         "labels": np.array([[1, 9, IGNORE_INDEX]])}
    check_batch(b, ed)
    with pytest.raises(ValueError, match=r"batch\['labels'\]: target 10 is outside \[0, 10\)"):
        check_batch({**b, "labels": np.array([[1, 10, 2]])}, ed)
    with pytest.raises(ValueError, match=r"batch\['tgt'\]: token id 12 is outside the vocabulary \[0, 10\)"):
        check_batch({**b, "tgt": np.array([[1, 12, 2]])}, ed)


# 4. Where data enters: tasks, the training loop, eval, the checked train step ---------------------
TC = TrainConfig(steps=2, batch_size=4, seq_len=16, grad_accum=2, eval_batches=1, log_every=1)


@pytest.fixture(scope="module")
def lm_task():
    config = ModelConfig(vocab_size=1, d_model=16, n_layer=1, n_head=2, max_len=16)
    task = load_task(config, TC, corpus="seed-synthetic")
    return fit_config(config, task), task


def test_task_rejects_ids_outside_its_tokenizer(lm_task):
    _, task = lm_task
    x, y = np.zeros((4, 8), np.int32), np.zeros((4, 8), np.int32)
    y[2, 5] = -1
    with pytest.raises(ValueError, match=r"training 'y': target -1 is outside \[0, 33\) .* at position \(2, 5\)"):
        dataclasses.replace(task, kind="pairs", train=(x, y), val=(x, y))
    ids = task.train[0].copy()
    ids[7] = 33
    with pytest.raises(ValueError, match=r"training 'ids': token id 33 is outside the vocabulary \[0, 33\) at "
                                         r"position \(7,\)"):
        dataclasses.replace(task, train=(ids,))


def test_loop_and_eval_check_batches_on_the_host(lm_task, tmp_path):
    config, task = lm_task
    small = config.replace(vocab_size=10)  # the data's ids reach 32: what jit would clamp silently
    with pytest.raises(ValueError, match=r"batch\['x'\]: token id \d+ is outside the vocabulary \[0, 10\)"):
        fit(small, TC, task, tmp_path, progress=False)
    params = init_state(small, TC).params
    with pytest.raises(ValueError, match=r"batch\['x'\]: token id \d+ is outside the vocabulary \[0, 10\)"):
        evaluate(small, params, task.eval_batches(TC))
    with pytest.raises(ValueError, match=r"batch\['x'\]: token id \d+ is outside the vocabulary \[0, 10\)"):
        make_eval_step(small, checked=True)(params, task.eval_batches(TC)[0])


@pytest.mark.slow  # a checkified train step compiles for ~17 s: make test-slow
def test_checked_train_step(lm_task):
    config, task = lm_task
    batch = task.batch(TC, 0)  # (grad_accum=2, micro_batch=2, T): the micro-batches are a lax.scan
    plain, strict = make_train_step(config, TC), make_train_step(config, TC, checked=True)
    _, m1 = plain(init_state(config, TC), batch)
    _, m2 = strict(init_state(config, TC), batch)
    assert float(m1["loss"]) == float(m2["loss"])  # same program when the data is good
    bad = {k: v.copy() for k, v in batch.items()}
    bad["y"][1, 0, 3] = -1
    plain(init_state(config, TC), bad)  # plain jit: the -1 is scored as the last class, no error
    with pytest.raises(ValueError, match=r"batch\['y'\]: target -1 is outside \[0, 33\) and is not the ignore "
                                         r"index -100 at position \(1, 0, 3\)"):
        strict(init_state(config, TC), bad)


def test_checks_compile_away_outside_checked_mode(params, monkeypatch):
    """Benchmark-neutral: without checkify the checks leave the compiled program unchanged
    (the same multiset of HLO instructions as with every check replaced by a no-op)."""
    import collections
    import re

    from jax.experimental import checkify

    def ops(f, *args):  # a new function object each time: no cached trace from the other call
        text = jax.jit(lambda *a: f(*a)).lower(*args).compile().as_text()
        return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))

    m, tok = build(CFG), jnp.ones((2, 3), jnp.int32)
    forward = lambda p, c, t: m.apply({"params": p}, t, cache=c).logits
    args = (params, init_cache(CFG, 2, 8), tok)
    with_checks = ops(forward, *args)
    for module, name in [(checks, "check_in_range"), (checks, "check_cache_room"), (checkify, "debug_check")]:
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    assert ops(forward, *args) == with_checks and sum(with_checks.values()) > 20


def test_checks_leave_no_effect_outside_checked_mode(params):
    """A check traced outside checkify compiles away but leaves an error effect on the jaxpr, and
    an effect turns off jit's C++ dispatch (about 1 ms of Python per call): outside ``checked``
    the checks are not traced at all, and the jitted call takes the fast path."""
    import jax._src.pjit as pjit_internals

    m, tok = build(CFG), jnp.ones((2, 3), jnp.int32)
    forward = lambda p, c, t: m.apply({"params": p}, t, cache=c).logits
    args = (params, init_cache(CFG, 2, 8), tok)
    assert jax.make_jaxpr(forward)(*args).effects == set()
    with checks.checking():  # a new function object: no trace cached from the call above
        assert jax.make_jaxpr(lambda *a: forward(*a))(*args).effects  # checked mode carries them
    fast = jax.jit(forward)
    fast(*args)
    slow_calls = []
    orig = pjit_internals._run_python_pjit
    pjit_internals._run_python_pjit = lambda *a, **k: slow_calls.append(1) or orig(*a, **k)
    try:
        for _ in range(3):
            fast(*args)
    finally:
        pjit_internals._run_python_pjit = orig
    assert slow_calls == []


# 5. Masks ---------------------------------------------------------------------------------------
def test_bad_masks_are_errors_in_both_frameworks(rng):
    q, k = rng.standard_normal((2, 3, 2, 4)).astype(np.float32), rng.standard_normal((2, 5, 2, 4)).astype(np.float32)
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    for mask, msg in [(np.zeros((2, 1, 1, 5), np.float32), r"mask must be bool .* got dtype float32"),
                      (np.ones((2, 6), bool), r"mask has shape \(2, 6\); expected a bool mask broadcastable to "
                                              r"\(B, H, Tq, Tk\) = \(2, 2, 3, 5\)"),
                      (np.ones((2, 1, 1, 1, 5), bool), r"mask has shape \(2, 1, 1, 1, 5\)")]:
        with pytest.raises(ValueError, match=msg):
            sdpa(q, k, k, mask=mask)
        with pytest.raises(ValueError, match=msg):
            tattn.scaled_dot_product_attention(tq, tk, tk, mask=torch.from_numpy(mask))
        with pytest.raises(ValueError, match=msg):
            tattn.scaled_dot_product_attention(tq, tk, tk, mask=torch.from_numpy(mask), return_weights=True)
    # With a cache the mask spans its S slots; one slot more is an error, not a silent crop.
    a, p = _attention()
    ta = load_params(tattn.Attention(8, 2), jax.device_get(p))
    m = np.ones((1, 1, 1, 5), bool)
    with pytest.raises(ValueError, match=r"mask has shape \(1, 1, 1, 5\); .* = \(1, 2, 3, 4\)"):
        a.apply({"params": p}, jnp.ones((1, 3, 8)), mask=m, cache=KVCache.init(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"mask has shape \(1, 1, 1, 5\); .* = \(1, 2, 3, 4\)"):
        ta(torch.ones(1, 3, 8), mask=torch.from_numpy(m), cache=tattn.KVCache.init(1, 2, 4, 4))


def test_bad_padding_masks_are_errors_in_both_frameworks():
    bert = BertConfig(ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_len=8, pos="learned"),
                      n_classes=3)
    jm, ids = build(bert), np.ones((2, 4), np.int32)
    p = jm.init(jax.random.PRNGKey(0), ids, np.ones((2, 4), bool))["params"]
    tm = load_params(torch_ref.build(bert), jax.device_get(p), stacked=("layers",)).eval()
    assert np.isfinite(np.asarray(jm.apply({"params": p}, ids, np.array([[1, 1, 0, 0], [1, 0, 0, 0]])))).all()
    for mask, msg in [(np.zeros((2, 4), np.float32), r"attention_mask must be bool or 0/1 integers .* float32"),
                      (np.array([[1, 1, 2, 0], [1, 0, 0, 0]]), r"attention_mask value 2 is neither 0 \(padding\) nor 1 "
                                                               r"\(real token\) at position \(0, 2\)")]:
        with pytest.raises(ValueError, match=msg):
            jm.apply({"params": p}, ids, mask)
        with pytest.raises(ValueError, match=msg):
            tm(torch.from_numpy(ids), torch.from_numpy(mask))
    bad = np.array([[1, 1, 2, 0], [1, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask value 2 is outside the 0/1 values \[0, 2\) at "
                                         r"position \(0, 2\)"):
        checked(lambda m: jm.apply({"params": p}, ids, m))(bad)


def _pair(d, h, h_kv, **kw):
    return Attention(d_model=d, n_head=h, n_kv_head=h_kv, **kw), tattn.Attention(d, h, h_kv, **kw)


@pytest.mark.parametrize("h,h_kv", [(4, 4), (4, 2)])
def test_fully_masked_rows_are_zeros_with_zero_grads_self_attention(h, h_kv, rng):
    """Key padding: batch row 1 has no real key at all. Both frameworks give zeros there and
    agree at 1e-5 forward and in every gradient (no NaN from a 0/0 softmax)."""
    d = 8 * h
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    mask = np.ones((2, 1, 1, 5), bool)
    mask[0, ..., 3:] = False
    mask[1] = False
    ja, ta = _pair(d, h, h_kv, qkv_bias=True, o_bias=False)
    p = check_module("Attention (fully masked rows)", ja, ta, [x], jax_kwargs=dict(mask=mask),
                     torch_kwargs=dict(mask=torch.from_numpy(mask)), select=lambda o: o[0])
    y, _, w = ja.apply({"params": p}, x, mask=mask, return_weights=True)
    assert np.abs(np.asarray(w[1])).max() == 0.0 and np.abs(np.asarray(y[1])).max() == 0.0
    g = jax.grad(lambda p: jnp.sum(ja.apply({"params": p}, x, mask=mask)[0][1] ** 2))(p)  # row 1 alone
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))
    assert np.abs(np.asarray(g["q_proj"]["kernel"])).max() == 0.0  # q never reaches the output there


def test_fully_masked_rows_cross_attention(rng):
    """A fully padded source sequence (row 1): zeros and equal gradients in both frameworks."""
    d = 32
    x, ctx = rng.standard_normal((2, 4, d)).astype(np.float32), rng.standard_normal((2, 6, d)).astype(np.float32)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[0, ..., 4:] = False
    mask[1] = False
    ja, ta = _pair(d, 4, 2, qkv_bias=True, o_bias=True)
    check_module("Attention (cross, fully masked rows)", ja, ta, [x, ctx], jax_kwargs=dict(mask=mask),
                 torch_kwargs=dict(mask=torch.from_numpy(mask)), select=lambda o: o[0])
