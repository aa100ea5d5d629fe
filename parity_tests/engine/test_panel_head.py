"""The engine's packed vocabulary projection (kernels/cpu/panel_matmul.cc, kernels/panel_ffi.py,
inference/packed_head.py).

The kernel against a float64 NumPy reference (logits + bias, the padded vocabulary at float32's
minimum; tolerance 1e-5 on unit-scale logits) and its argmax against ``sampling.argmax`` run by XLA
on the kernel's own logits (first maximum, first NaN), over row counts that cover every register
tile and column counts that end inside a panel. Then the engine with head_kernel='panel' against
'xla' (a self-consistency check; test_engine.py checks 'auto', the panel head where the kernel
builds, against transformers): identical greedy tokens, logprobs within 1e-5, for untied, tied, biased
and padded-vocabulary heads, with and without speculative decoding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference import packed_head
from jaxgpt.inference.engine import Engine
from jaxgpt.inference.sampling import SamplingParams, argmax
from jaxgpt.models import abstract_params
from jaxgpt.nn.kernels import calibrate, panel_ffi
from parity_tests.unit.test_calibrate import arms_spy

pytestmark = pytest.mark.skipif(not panel_ffi.available(), reason="no C++ compiler: the kernel cannot be built")
F32_MIN = np.finfo(np.float32).min


@pytest.mark.parametrize("k,n,valid,bias", [(64, 1000, 1000, False), (48, 77, 70, True), (16, 64, 64, True),
                                            (128, 8200, 8190, False)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 40])
def test_logits_and_argmax_match_references(k, n, valid, bias, m):
    rng = np.random.default_rng(k + n + m)
    w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)  # unit-scale logits
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    x = rng.standard_normal((m, k)).astype(np.float32)
    y, top = panel_ffi.panel_matmul(jnp.asarray(x), panel_ffi.pack(w), n, None if b is None else jnp.asarray(b), valid)
    ref = x.astype(np.float64) @ w.astype(np.float64) + (0.0 if b is None else b)
    y = np.asarray(y)
    np.testing.assert_allclose(y[:, :valid], ref[:, :valid], rtol=0, atol=1e-5)
    assert (y[:, valid:] == F32_MIN).all(), "the padded vocabulary is at float32's minimum"
    np.testing.assert_array_equal(np.asarray(top), np.asarray(argmax(jnp.asarray(y))))


def test_argmax_ties_and_nans_pick_the_first_across_panels_and_threads():
    """The first of equal maxima, and the first NaN, wherever they fall: within a vector, in another
    panel, or in the part another thread took (8,200 columns x 128: two parts on two threads)."""
    k, n = 128, 8200
    x = jnp.zeros((3, k), jnp.float32)
    panels = panel_ffi.pack(np.zeros((k, n), np.float32))
    bias = np.zeros(n, np.float32)
    bias[[7000, 100, 8199]] = 2.0
    assert np.asarray(panel_ffi.panel_matmul(x, panels, n, jnp.asarray(bias))[1]).tolist() == [100] * 3
    bias[[8100, 5000]] = np.nan
    assert np.asarray(panel_ffi.panel_matmul(x, panels, n, jnp.asarray(bias))[1]).tolist() == [5000] * 3
    assert np.asarray(panel_ffi.panel_matmul(x, panels, n)[1]).tolist() == [0] * 3, "all equal: column 0"
    minus_inf = jnp.full((n,), -jnp.inf, jnp.float32)
    assert np.asarray(panel_ffi.panel_matmul(x, panels, n, minus_inf)[1]).tolist() == [0] * 3, "all -inf: column 0"


def test_bad_shapes_and_limits_are_refused():
    panels = panel_ffi.pack(np.zeros((16, 100), np.float32))  # 2 panels
    with pytest.raises(ValueError, match=r"panels \(ceil\(n / 64\), K, 64\) for n=200"):
        panel_ffi.panel_matmul(jnp.zeros((1, 16)), panels, 200)
    with pytest.raises(ValueError, match=r"valid=101 must be in \(0, n=100\]"):
        panel_ffi.panel_matmul(jnp.zeros((1, 16)), panels, 100, valid=101)
    with pytest.raises(ValueError, match="head_kernel='fast' is not one of"):
        packed_head.resolve_head_kernel("fast", ModelConfig(vocab_size=8, d_model=8, n_layer=1, n_head=1, max_len=8))
    bf16 = ModelConfig(vocab_size=8, d_model=8, n_layer=1, n_head=1, max_len=8, dtype="bfloat16")
    with pytest.raises(ValueError, match="head_kernel='panel': the panel kernel is float32; this model computes in bfloat16"):
        packed_head.resolve_head_kernel("panel", bf16)
    assert packed_head.resolve_head_kernel("auto", bf16) == "xla"


def _model(seed=0, **kw):
    cfg = ModelConfig(**{**dict(vocab_size=100, d_model=32, n_layer=2, n_head=4, max_len=64,
                                pos="rope"), **kw})
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.3, a.dtype), abstract_params(cfg))
    return cfg, params


def _run(cfg, params, head_kernel, draft=None, logprobs=False):
    """Five ragged greedy requests through four rows -> (engine, tokens, logprobs). Without logprobs
    the tokens are the forward's argmax (the panel kernel's own); with them, the sampling program's."""
    eng = Engine(cfg, params, max_seqs=4, page_size=8, head_kernel=head_kernel, draft=draft, spec_max_batch=4)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, cfg.token_vocab, int(rng.integers(2, 20)))] for _ in range(5)]
    sp = SamplingParams(max_tokens=12, logprobs=logprobs, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    toks, logps = {i: [] for i in ids}, {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.id] += o.new_token_ids
            logps[o.id] += o.new_logprobs
    return eng, [toks[i] for i in ids], [logps[i] for i in ids]


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True), dict(lm_head_bias=True),
                                dict(vocab_size=128, valid_vocab=100)], ids=["untied", "tied", "bias", "padded"])
def test_engine_panel_head_equals_the_models_head(kw):
    cfg, params = _model(**kw)
    panel, toks, _ = _run(cfg, params, "panel")
    xla, ref_toks, _ = _run(cfg, params, "xla")
    assert panel.head_kernel == "panel" and xla.head_kernel == "xla" and xla.head is None
    assert toks == ref_toks
    _, toks_lp, logps = _run(cfg, params, "panel", logprobs=True)
    _, _, ref_logps = _run(cfg, params, "xla", logprobs=True)
    assert toks_lp == ref_toks
    np.testing.assert_allclose(np.concatenate(logps), np.concatenate(ref_logps), rtol=0, atol=1e-5)
    assert max(max(t) for t in toks) < cfg.token_vocab, "no padded id is ever picked"
    # the packed copy replaces an untied lm_head: the engine holds the head's weight once
    assert "lm_head" not in panel.params and ("lm_head" in xla.params) != cfg.tie_embeddings
    assert panel.head["panels"].shape == (-(-cfg.vocab_size // 64), cfg.d_model, 64)


def test_speculative_engine_with_panel_heads_equals_plain_decoding():
    cfg, params = _model()
    dcfg, dparams = _model(seed=3, n_layer=1)
    _, toks, _ = _run(cfg, params, "panel", draft=(dcfg, dparams))
    _, ref, _ = _run(cfg, params, "xla")
    assert toks == ref


@pytest.mark.parametrize("kernel_wins", [True, False])
def test_auto_follows_the_stored_measurement(tmp_path, monkeypatch, kernel_wins):
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path))
    monkeypatch.setenv(calibrate.ENV, "auto")
    calls = []
    monkeypatch.setattr(panel_ffi, "_measure", lambda: calls.append(1) or dict(wins=kernel_wins))
    panel_ffi.wins.cache_clear()
    try:
        cfg, params = _model()
        eng = Engine(cfg, params, max_seqs=2, page_size=8)
        assert eng.head_kernel == ("panel" if kernel_wins else "xla") and len(calls) == 1
    finally:
        panel_ffi.wins.cache_clear()


def test_the_measurement_times_both_paths(monkeypatch):
    """The real measurement (about a second): at each row count the kernel arm's program calls the
    kernel and the XLA arm's does not (test_calibrate.arms_spy), both give the same argmaxes (their
    sum: equal), every figure is set, and the rule's margin is applied to them."""
    arms = arms_spy(monkeypatch)
    r = panel_ffi._measure()
    rows = panel_ffi.CALIBRATION_ROWS
    assert [targets for targets, _ in arms] == [{panel_ffi.TARGET}, set()] * len(rows), "each arm must time its path"
    assert all(a[1] == b[1] for a, b in zip(arms[::2], arms[1::2]))
    assert all(r[f"kernel_s_rows{m}"] > 0 and r[f"xla_s_rows{m}"] > 0 for m in rows)
    assert r["wins"] == all(r[f"kernel_s_rows{m}"] < panel_ffi.MARGIN * r[f"xla_s_rows{m}"] for m in rows)


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True), dict(lm_head_bias=True),
                                dict(vocab_size=128, valid_vocab=100),
                                dict(vocab_size=128, valid_vocab=100, logit_softcap=1.0)],
                         ids=["untied", "tied", "bias", "padded", "softcap"])
def test_hidden_states_projected_by_the_packed_head_are_the_models_logits(kw):
    """``DecoderLM(hidden=True)`` + ``packed_head.project`` against the model's own head, on every position
    of a batch (1e-5: another summation order over d)."""
    from jaxgpt.models.decoder import DecoderLM

    cfg, params = _model(**kw)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.token_vocab, (3, 9)))
    logits = DecoderLM(cfg).apply({"params": params}, tokens)
    h = DecoderLM(cfg).apply({"params": params}, tokens, hidden=True)
    assert h.shape == (3, 9, cfg.d_model)
    got, top = packed_head.project(cfg, packed_head.pack_head(cfg, params), h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(logits), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(argmax(got)))
