"""A mixture of token directories (jaxgpt/data/mixture_task.py) beyond its shapes: what evaluation
reads, and packed documents across sources.

Two sources whose ids name them (web: 1-11, code: 12-23; EOS 0 after every document) and whose
val.bin differs from their train.bin. References the test computes itself: the schedule
(``jaxgpt.data.order.mixture_samples``) for each row's source; the source's val.bin for what an
evaluation row may hold; segment ids and positions walked token by token in Python; and each
document of a packed batch run alone through the model at its positions, whose mean loss the
packed batch's ``loss_terms`` must equal (1e-5; a self-consistency check: both are jaxgpt). The
rows of a global batch read by two processes (``rows``) assemble the one-process batch.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import assert_self_consistent, randomize
from jaxgpt import PRESETS, build
from jaxgpt.config import TrainConfig
from jaxgpt.data.order import mixture_samples
from jaxgpt.train.losses import loss_terms
from jaxgpt.data.mixture_task import mixture_task

EOS, VOCAB, WEB = 0, 24, 12  # ids below WEB (but EOS) are web's, the rest code's


def _packed(rng, lo, hi, n_tokens):
    """Documents of 3-12 ids in [lo, hi), each followed by EOS, to at least n_tokens."""
    out = []
    while len(out) < n_tokens:
        out += [int(t) for t in rng.integers(lo, hi, int(rng.integers(3, 13)))] + [EOS]
    return np.asarray(out, np.uint16)


def _token_dir(path, lo, hi, seed):
    """jaxgpt's layout (meta.json with the EOS id); val.bin drawn apart from train.bin."""
    path.mkdir()
    rng = np.random.default_rng(seed)
    train, val = _packed(rng, lo, hi, 3000), _packed(rng, lo, hi, 400)
    train.tofile(path / "train.bin")
    val.tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16", "eos_id": EOS}))
    return path, train, val


@pytest.fixture
def sources(tmp_path):
    return _token_dir(tmp_path / "web", 1, WEB, 0), _token_dir(tmp_path / "code", WEB, VOCAB, 1)


def _source_of(rows) -> np.ndarray:
    """(N, T) windows -> (N,) 0 for web, 1 for code; every window holds one source's ids only."""
    docs = np.where(rows == EOS, -1, rows)
    web, code = ((docs >= 1) & (docs < WEB)).any(-1), (docs >= WEB).any(-1)
    assert not (web & code).any(), "a window mixes the sources"
    return code.astype(int)


def _is_window_of(row, tokens) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, np.int32), len(row))
    return bool((windows == row).all(-1).any())


def _by_hand(x):
    """Segment ids (the EOS count up to and including each token) and positions in the document
    (0 at each EOS and at the window's start), walked token by token."""
    seg, pos = np.zeros_like(x), np.zeros_like(x)
    for r, row in enumerate(x):
        s, p = 0, -1
        for t, tok in enumerate(row):
            s, p = (s + 1, 0) if tok == EOS else (s, p + 1)
            seg[r, t], pos[r, t] = s, p
    return seg, pos


@pytest.mark.parametrize("documents", ["stream", "masked"])
def test_eval_batches_read_each_sources_val_in_the_schedules_order(sources, documents):
    (web, web_train, web_val), (code, _, code_val) = sources
    tc = TrainConfig(batch_size=4, seq_len=16, eval_batches=5, documents=documents)
    task = mixture_task(f"{web}=0.75,{code}=0.25", tc)
    assert task.counts == (3, 1)
    batches = task.eval_batches(tc)
    assert len(batches) == 5
    for i, b in enumerate(batches):
        want, _ = mixture_samples(task.counts, i * tc.micro_batch + np.arange(tc.micro_batch))
        got = _source_of(b["x"])
        assert got.tolist() == want.tolist(), (i, got, want)
        for row_x, row_y, j in zip(b["x"], b["y"], got):
            window = np.concatenate([row_x, row_y[-1:]])
            assert (row_y[:-1] == row_x[1:]).all() and _is_window_of(window, (web_val, code_val)[j])
        if documents == "masked":
            assert (b["segment_ids"] == _by_hand(b["x"])[0]).all()
    sizes = np.bincount(np.concatenate([_source_of(b["x"]) for b in batches]), minlength=2)
    assert sizes.tolist() == [15, 5]  # 20 rows, exactly 3:1
    again = task.eval_batches(tc)
    assert all((a["x"] == b["x"]).all() for a, b in zip(batches, again))  # fixed by the seed
    train_rows = task.batch(tc, 0)["x"].reshape(-1, 16)
    assert any(_is_window_of(r, web_train) for r in train_rows if _source_of(r[None])[0] == 0)


@pytest.mark.parametrize("documents", ["masked", "isolated"])
def test_packed_documents_across_sources_lose_what_each_document_alone_loses(sources, documents):
    """Segment ids (and positions for 'isolated') against the walk by hand; the batch's loss_terms
    against each document run alone at its positions (its place in the row for 'masked', from 0 for
    'isolated'), right-padded in a row of its own; 'stream' on the same rows differs."""
    (web, *_), (code, *_) = sources
    tc = TrainConfig(batch_size=4, seq_len=32, documents=documents, val_fraction=0.0)
    task = mixture_task(f"{web}=0.5,{code}=0.5", tc)
    batch = {k: a[0] for k, a in task.batch(tc, 3).items()}  # (micro_batch, T)
    x, y = batch["x"], batch["y"]
    assert sorted(_source_of(x).tolist()) == [0, 0, 1, 1]
    seg, pos = _by_hand(x)
    assert (batch["segment_ids"] == seg).all()
    assert ("positions" in batch) == (documents == "isolated")
    if documents == "isolated":
        assert (batch["positions"] == pos).all()
    assert (seg[:, -1] > 0).all(), "every row should pack several documents"
    cfg = PRESETS["gpt2-small"].replace(vocab_size=VOCAB, d_model=32, n_head=4, n_layer=1, max_len=64, dropout=0.0,
                                        attn_dropout=0.0)  # learned positions: a wrong position shows
    model = build(cfg)
    params = randomize(model.init(jax.random.PRNGKey(0), x[:1])["params"])  # unit scale: context matters
    docs = [np.flatnonzero(seg[r] == s) + r * x.shape[1] for r in range(len(x)) for s in np.unique(seg[r])]
    t = x.shape[1]
    xs, ys, ps = (np.zeros((len(docs), t), np.int32) for _ in range(3))
    for i, at in enumerate(docs):
        n, start = len(at), at[0] % t
        xs[i, :n], ys[i, :n] = x.reshape(-1)[at], y.reshape(-1)[at]
        ps[i] = np.arange(t) + (start if documents == "masked" else 0)  # the padding after a document is causal
    logp = jax.nn.log_softmax(model.apply({"params": params}, xs, positions=ps))
    nll = -np.take_along_axis(np.asarray(logp), ys[..., None], -1)[..., 0]
    alone = sum(nll[i, :len(at)].sum() for i, at in enumerate(docs)) / x.size
    terms = loss_terms(cfg, params, batch)
    assert int(terms["count"]) == x.size  # no target is masked out: an EOS predicts from itself alone
    assert_self_consistent(terms["loss_sum"] / terms["count"], alone,
                           f"mixture packed documents ({documents}) vs each document alone (mean loss)")
    stream = loss_terms(cfg, params, {"x": x, "y": y})
    assert abs(float(stream["loss_sum"] / stream["count"]) - alone) > 1e-3  # the documents' walls matter here


def test_two_processes_rows_assemble_the_global_batch(sources):
    """Each process reads only its rows of a global batch (``rows``; the others stay zero): two
    halves put together are the one-process batch, for both orders."""
    (web, *_), (code, *_) = sources
    for order in ("random", "epochs"):
        tc = TrainConfig(batch_size=8, seq_len=16, data_order=order, val_fraction=0.0)
        task = mixture_task(f"{web}=0.7,{code}=0.3", tc)
        samples = 5 * tc.batch_size + np.arange(tc.batch_size)
        whole = task._windows(task.train, samples, tc, 5, None, order == "epochs")
        halves = [task._windows(task.train, samples, tc, 5, rows, order == "epochs")
                  for rows in (np.arange(4), np.arange(4, 8))]
        assert (halves[0][4:] == 0).all() and (halves[1][:4] == 0).all()
        assert (halves[0] + halves[1] == whole).all()
        assert (whole[:, :-1] == task.batch(tc, 5)["x"].reshape(8, 16)).all()  # what batch() reads alone
