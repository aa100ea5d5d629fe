"""Training: schedule, loss, optimizer and whole training runs against torch_ref.

Tolerances: learning rates 1e-6 relative (float32 jnp vs Python float); cross entropy 1e-5;
20-step loss curves 1e-5 (AttnRes: 1e-4, as for its gradients; see the summary table).
"""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch

import torch_ref
from jaxgpt.config import EncDecConfig, ModelConfig, TrainConfig, get_preset
from jaxgpt.data import IGNORE_INDEX, builtin_pairs
from jaxgpt.models import abstract_params
from jaxgpt.train import cross_entropy, init_state, make_train_step, schedule
from jaxgpt.train.optim import DECAY_MASKS, decay_mask
from jaxgpt.data.tasks import classify_task, fit_config, load_task, pairs_task
from conftest import (assert_as_accurate_as_torch, assert_close, assert_self_consistent, float64_module,
                      float64_torch)
from torch_ref.convert import load_params
from torch_ref.train import make_optimizer, train

TINY = dict(d_model=32, n_layer=2, n_head=4, max_len=64)


def _torch_lrs(opt, sched, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedule_is_the_seeds_cosine_in_both_frameworks():
    """TrainConfig.lr_at is the one formula: evaluated in jnp it is the optax schedule, on Python
    floats torch_ref's LambdaLR. Both are checked against torch's own CosineAnnealingLR (seed 000's
    schedule, an independent reference) and the warmup against its definition."""
    tc = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    f = jax.jit(schedule(tc))
    ours = np.array([float(f(s)) for s in range(tc.steps)])
    np.testing.assert_allclose(ours, [tc.lr_at(s) for s in range(tc.steps)], rtol=1e-6)  # float32 vs float64
    np.testing.assert_allclose(ours[:10], 1e-3 * np.arange(1, 11) / 10, rtol=1e-6)  # warmup reaches lr at step 9
    model = torch.nn.Linear(2, 2)
    np.testing.assert_allclose(_torch_lrs(*make_optimizer(model, tc), tc.steps), ours, rtol=1e-6)
    # No warmup: seed 000's CosineAnnealingLR(T_max=steps, eta_min=0.1 lr), in both frameworks
    tc0 = tc.replace(warmup_steps=0)
    opt = torch.optim.AdamW(model.parameters(), lr=tc0.lr)
    seed_lrs = _torch_lrs(opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=tc0.steps, eta_min=tc0.lr * 0.1),
                          tc0.steps)
    np.testing.assert_allclose([tc0.lr_at(s) for s in range(tc0.steps)], seed_lrs, rtol=1e-9)
    np.testing.assert_allclose(_torch_lrs(*make_optimizer(model, tc0), tc0.steps), seed_lrs, rtol=1e-9)
    f0 = jax.jit(schedule(tc0))
    np.testing.assert_allclose([float(f0(s)) for s in range(tc0.steps)], seed_lrs, rtol=1e-6)


def test_cross_entropy_matches_torch_with_ignore_index(rng):
    logits = rng.standard_normal((3, 7, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, (3, 7))
    targets[0, :3] = IGNORE_INDEX
    total, count, correct = cross_entropy(logits, targets)
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(logits).flatten(0, 1), torch.from_numpy(targets).flatten(),
                                            ignore_index=IGNORE_INDEX, reduction="sum")
    assert int(count) == 18
    assert_close(float(total) / 18, float(ref) / 18, "cross entropy (ignore index) vs F.cross_entropy")
    keep = targets != IGNORE_INDEX
    assert int(correct) == int(((logits.argmax(-1) == targets) & keep).sum())


def test_linear_decay_mask_is_torchs_linear_weights():
    cfg = get_preset("llama-tiny").replace(**TINY, tie_embeddings=False)
    params = init_state(cfg, TrainConfig()).params
    mask = decay_mask(params)
    decayed = sum(p.size for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if m)
    model = torch_ref.build(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert decayed == linear > 0
    assert decayed < sum(p.size for p in jax.tree.leaves(params))  # norms and embeddings are excluded


def test_matrices_decay_mask_is_nanogpts_two_d_params():
    """decay='matrices': nanoGPT decays every parameter with dim >= 2 (Linear weights and both
    embedding tables), never norm gains or biases; here with scanned (L, d) norm scales."""
    cfg = get_preset("gpt2-small").replace(**TINY)
    params = init_state(cfg, TrainConfig()).params
    mask = DECAY_MASKS["matrices"](params)
    decayed = sum(p.size for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if m)
    model = torch_ref.build(cfg)
    two_d = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # nanoGPT's rule
    assert decayed == two_d > 0


def test_decay_masks_cover_moe_expert_weights():
    """MoE expert weights are Linear weights stacked (E, in, out): 'linear' and 'matrices' decay them
    (nanoGPT's >= 2-D rule; HF Trainer decays all but biases and norms), in both frameworks."""
    from jaxgpt.config.moe import MoEConfig

    cfg = get_preset("llama-tiny").replace(**TINY, moe=MoEConfig(n_experts=4, top_k=2))
    params = abstract_params(cfg)  # shapes suffice: the masks are keyed on names
    model = torch_ref.build(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    two_d = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    for decay, expected in (("linear", two_d - model.tok_embed.weight.numel()), ("matrices", two_d)):
        mask = DECAY_MASKS[decay](params)
        decayed = sum(math.prod(p.shape) for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if m)
        opt, _ = make_optimizer(model, TrainConfig(decay=decay))
        torch_decayed = sum(p.numel() for g in opt.param_groups if g["weight_decay"] for p in g["params"])
        assert decayed == torch_decayed == expected and experts > 0, decay


def _classify_rows(n=48, seed=0):
    r = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        text = "".join(r.choice(list("abcxyz "), size=r.integers(5, 20)))
        rows.append((str(int("a" in text)), text))
    return rows


CASES = {
    # seed 000 defaults: decay everything, cosine to 0.1 lr, clip 1.0
    "seed-minigpt": (lambda: get_preset("seed-minigpt"), dict(), "seed-synthetic"),
    # LLaMA-style GQA + tied embeddings, decay on Linear kernels only, warmup, accumulation
    "llama-gqa-accum": (lambda: get_preset("llama-tiny").replace(**TINY, n_kv_head=2, tie_embeddings=True),
                        dict(decay="linear", weight_decay=0.5, warmup_steps=5, grad_accum=2), "seed-synthetic"),
    # GPT-2 style: learned positions, LayerNorm + biases, tanh GELU; constant lr, no clipping
    "gpt2-constant": (lambda: get_preset("gpt2-small").replace(**TINY, dropout=0.0, attn_dropout=0.0),
                      dict(schedule="constant", grad_clip=None, lr=1e-3), "seed-synthetic"),
    # nanoGPT's recipe: decay on Linear kernels and embeddings (tied head), warmup + cosine
    "gpt2-matrices": (lambda: get_preset("gpt2-small").replace(**TINY, dropout=0.0),
                      dict(decay="matrices", weight_decay=0.5, warmup_steps=5, beta2=0.99), "seed-synthetic"),
    # decoder on padded zh-en pairs: padding targets are IGNORE_INDEX
    "pairs-lm": (lambda: get_preset("seed-attnres-standard").replace(**TINY), dict(seq_len=40), "zh-en"),
    "attnres-block": (lambda: get_preset("seed-attnres-block").replace(**{**TINY, "n_layer": 4}, attnres_blocks=2),
                      dict(seq_len=40), "zh-en"),
    "encdec": (lambda: EncDecConfig(get_preset("seed-transformer").encoder.replace(**TINY),
                                    get_preset("seed-transformer").decoder.replace(**TINY)), dict(seq_len=40), "zh-en"),
    "minibert": (lambda: get_preset("seed-minibert").replace(
        encoder=get_preset("seed-minibert").encoder.replace(**TINY, dropout=0.0, attn_dropout=0.0)), dict(), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_loss_curve_matches_torch_ref(name):
    make_config, train_kw, corpus = CASES[name]
    tc = TrainConfig(steps=20, batch_size=8, seq_len=32, lr=3e-3, seed=3).replace(**train_kw)
    config = make_config()
    if corpus is None:
        task = classify_task(_classify_rows(), tc)
    else:
        task = load_task(config, tc, corpus=corpus)
    config = fit_config(config, task)
    state = init_state(config, tc)
    model = load_params(torch_ref.build(config), jax.device_get(state.params))
    step = make_train_step(config, tc)
    ours = []
    for s in range(tc.steps):
        state, m = step(state, task.batch(tc, s))
        ours.append(float(m["loss"]))
    exact = None
    if name.startswith("attnres"):  # before train() updates model in place: the same initial weights
        with float64_torch():
            exact = [m["loss"] for m in train(float64_module(model).requires_grad_(True), tc, task)]
    ref = [m["loss"] for m in train(model, tc, task)]
    assert ours[-1] < ours[0]  # it learns
    component = f"training: 20-step losses vs torch_ref ({name})"
    if exact is None:
        assert_close(np.array(ours), np.array(ref), component)
    else:
        # AttnRes: 1e-4, the conditioning bound of its gradients (test_attnres.py). Over 20 updates two float32
        # runs drift apart by ~1e-4 through rounding alone (8.9e-5 on one device, 1.4e-4 with the batch split
        # over two), so each is judged against torch_ref trained in float64 on the same weights and batches.
        assert_as_accurate_as_torch(np.array(ours), np.array(ref), np.array(exact), component, tol=1e-4,
                                    direct=False)


def test_grad_accumulation_equals_one_big_batch():
    config = get_preset("seed-minigpt").replace(n_layer=2)
    tc = TrainConfig(steps=5, batch_size=8, seq_len=32)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    losses = {}
    for accum in (1, 4):
        t = tc.replace(grad_accum=accum)
        state, step = init_state(config, t), make_train_step(config, t)
        losses[accum] = []
        for s in range(t.steps):
            state, m = step(state, task.batch(t, s))
            losses[accum].append(float(m["loss"]))
    assert task.batch(tc.replace(grad_accum=4), 0)["x"].shape == (4, 2, 32)
    assert_self_consistent(np.array(losses[4]), np.array(losses[1]), "training: gradient accumulation 4x2 vs 1x8 losses")


def test_train_step_compiles_once_and_donates_the_state():
    config = get_preset("seed-minigpt").replace(n_layer=1)
    tc = TrainConfig(steps=4, batch_size=4, seq_len=16)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    state, step = init_state(config, tc), make_train_step(config, tc)
    old = state
    for s in range(3):
        state, metrics = step(state, task.batch(tc, s))
    assert step._cache_size() == 1
    assert jax.tree.leaves(old.params)[0].is_deleted()  # donated: updated in place
    assert int(state.step) == 3 and set(metrics) == {"loss", "accuracy", "grad_norm", "lr", "nonfinite"}
    assert math.isfinite(float(metrics["grad_norm"]))


@pytest.mark.slow  # four dropout training runs, ~11 s: make test-slow
def test_dropout_keys_depend_on_the_step_only():
    config = get_preset("seed-minigpt").replace(n_layer=1, dropout=0.3)
    tc = TrainConfig(steps=2, batch_size=4, seq_len=16)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    step = make_train_step(config, tc)
    batch = task.batch(tc, 0)
    a = float(step(init_state(config, tc), batch)[1]["loss"])
    b = float(step(init_state(config, tc), batch)[1]["loss"])
    c = float(step(init_state(config, tc.replace(seed=1)).replace(params=init_state(config, tc).params), batch)[1]["loss"])
    assert a == b and a != c


def test_task_errors_name_the_problem():
    tc = TrainConfig(seq_len=8)
    with pytest.raises(ValueError, match="classifier trains on --data FILE.tsv"):
        load_task(get_preset("seed-minibert"), tc, corpus="seed-synthetic")
    with pytest.raises(ValueError, match="encoder-decoder trains on pairs"):
        load_task(get_preset("seed-transformer"), tc, corpus="seed-synthetic")
    with pytest.raises(ValueError, match="longest pair needs seq_len >= "):
        pairs_task(builtin_pairs(), tc, seq2seq=False)
    with pytest.raises(ValueError, match="label 'x' is not a non-negative integer"):
        classify_task([("x", "text")] * 40, tc)
    with pytest.raises(ValueError, match="batch_size=32"):
        classify_task(_classify_rows(n=10), tc)
    with pytest.raises(ValueError, match="not divisible by grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)
    assert isinstance(fit_config(ModelConfig(), load_task(ModelConfig(), tc, corpus="seed-synthetic")), ModelConfig)


# --- non-finite losses: skipped inside the jitted step, or training stops before saving -----------------------

def _poisoning(monkeypatch):
    """Make a batch whose inputs are all one token give a NaN loss and NaN gradients (a stand-in
    for a real overflow); every other batch trains as usual."""
    import jax.numpy as jnp

    import jaxgpt.train.step as step_module

    real = step_module.loss_terms

    def loss_terms(config, params, batch, **kw):
        terms = real(config, params, batch, **kw)
        x = batch["x"]
        poison = jnp.where(jnp.all(x == x.reshape(-1)[0]), jnp.nan, 1.0)
        return {**terms, "loss_sum": terms["loss_sum"] * poison}

    monkeypatch.setattr(step_module, "loss_terms", loss_terms)


def _poisoned_task(task, bad_step: int):
    def batch(tc, step, _batch=task.batch):
        b = _batch(tc, step)
        return {**b, "x": np.ones_like(b["x"])} if step == bad_step else b

    object.__setattr__(task, "batch", batch)  # frozen dataclass: patch this instance only
    return task


def _host(tree):
    return [np.array(a) for a in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_nonfinite_update_is_skipped_inside_the_jitted_step(monkeypatch, mode):
    _poisoning(monkeypatch)
    config = get_preset("seed-minigpt").replace(n_layer=1, d_model=32, d_ff=64)
    tc = TrainConfig(steps=4, batch_size=4, seq_len=16, on_nonfinite=mode)
    task = _poisoned_task(load_task(config, tc, corpus="seed-synthetic"), bad_step=1)
    config = fit_config(config, task)
    state, step = init_state(config, tc), make_train_step(config, tc)
    state, m0 = step(state, task.batch(tc, 0))
    before = _host((state.params, state.opt_state))  # copied: the state is donated
    state, m1 = step(state, task.batch(tc, 1))
    after = _host((state.params, state.opt_state))
    assert float(m0["nonfinite"]) == 0.0 and float(m1["nonfinite"]) == 1.0 and int(state.step) == 2
    if mode == "skip":  # params and optimizer state (its count included) are the old ones, bit for bit
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        state, m2 = step(state, task.batch(tc, 2))
        assert float(m2["nonfinite"]) == 0.0 and np.isfinite(float(m2["loss"]))
        assert all(np.isfinite(a).all() for a in _host(state.params))
    else:  # 'stop' leaves the step alone (the loop stops); the update really was NaN
        assert not all(np.isfinite(a).all() for a in after)


def _fit_poisoned(monkeypatch, tmp_path, mode):
    from jaxgpt.train.loop import fit

    _poisoning(monkeypatch)
    config = get_preset("seed-minigpt").replace(n_layer=1, d_model=32, d_ff=64)
    # log_every=5 and ckpt_every=4: the NaN of step 7 is still on the device when step 8 is due to be saved
    tc = TrainConfig(steps=12, batch_size=4, seq_len=16, log_every=5, ckpt_every=4, eval_every=0, eval_batches=1,
                     keep=5, on_nonfinite=mode)
    task = _poisoned_task(load_task(config, tc, corpus="seed-synthetic"), bad_step=6)  # update 7
    return fit(fit_config(config, task), tc, task, tmp_path, progress=False)


def _rows(run):
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_fit_stops_at_a_nonfinite_loss_without_saving_it(monkeypatch, tmp_path):
    from jaxgpt.train.checkpoint import Checkpoints
    from jaxgpt.train.loop import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match=r"^non-finite loss at step 7 \(loss nan, grad norm nan\); training "
                       r"stopped without saving it \(the last checkpoint, step 4, holds finite weights\)\. Lower lr "
                       r"\(now 0\.0003\) or add warmup, or set on_nonfinite=skip to skip such updates$"):
        _fit_poisoned(monkeypatch, tmp_path, "stop")
    ckpts = Checkpoints(tmp_path, create=False)
    assert ckpts.steps() == [4]  # step 8 was due, but after the NaN
    assert all(np.isfinite(a).all() for a in _host(ckpts.restore_params()[1]))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 8)) and rows[-1]["nonfinite"] == 1.0
    assert "nonfinite" not in rows[0]


def test_fit_skips_nonfinite_updates_and_counts_them(monkeypatch, tmp_path):
    from jaxgpt.train.checkpoint import Checkpoints

    summary = _fit_poisoned(monkeypatch, tmp_path, "skip")
    assert summary["skipped"] == 1
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if r.get("nonfinite")] == [7] and [r["step"] for r in rows if "loss" in r] == \
        list(range(1, 13))
    ckpts = Checkpoints(tmp_path, create=False)
    assert ckpts.steps() == [4, 8, 12]
    assert all(np.isfinite(a).all() for a in _host(ckpts.restore_params()[1]))


# --- fit without checkpoints: the loop every experiment trains through -------------------------------------------

def _no_orbax(monkeypatch):
    import jaxgpt.train.loop as loop

    def refuse(*a, **k):
        raise AssertionError("checkpoints=False must not create Checkpoints")

    monkeypatch.setattr(loop, "Checkpoints", refuse)


@pytest.mark.same_bits
@pytest.mark.slow  # three fit runs, ~25 s: make test-slow
def test_fit_without_checkpoints_returns_its_history(monkeypatch, tmp_path):
    """checkpoints=False, no run directory: nothing written, no orbax; the history holds every update's
    metrics (the same losses as calling the jitted step by hand on the same batches) and every
    evaluation row with on_eval's scores merged in; compile time is reported apart from training time."""
    from jaxgpt.train.loop import fit

    _no_orbax(monkeypatch)
    monkeypatch.chdir(tmp_path)
    config = get_preset("seed-minigpt").replace(n_layer=1, d_model=32, d_ff=64)
    tc = TrainConfig(steps=12, batch_size=4, seq_len=16, log_every=5, eval_every=4, eval_batches=1)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    logged, evals = [], []
    r = fit(config, tc, task, progress=False, checkpoints=False, on_log=logged.extend,
            on_eval=lambda step, params: evals.append(step) or {"extra": float(step)})
    assert list(tmp_path.iterdir()) == []
    train = [h for h in r["history"] if "loss" in h]
    assert [h["step"] for h in train] == list(range(1, 13)) and logged == train
    assert [(h["step"], h["extra"]) for h in r["history"] if "val_loss" in h] == [(4, 4.0), (8, 8.0), (12, 12.0)]
    assert evals == [4, 8, 12]
    state, step = init_state(config, tc), make_train_step(config, tc)
    by_hand = []
    for s in range(tc.steps):
        state, m = step(state, task.batch(tc, s))
        by_hand.append(float(m["loss"]))
    assert [h["loss"] for h in train] == by_hand  # bit for bit: same batches, same steps
    assert int(r["state"].step) == r["steps"] == 12 and r["plot"] is None
    assert r["compile_s"] > 0 and r["train_s"] > 0 and r["ms_per_step"] > 0
    assert r["compile_s"] > 5e-3 * r["ms_per_step"]  # the first update (tracing, compiling) is timed apart
    # until: the first updates of a longer run (its schedule unchanged); on_log returning True stops it
    head = fit(config, tc, task, progress=False, checkpoints=False, until=5)
    assert [h["loss"] for h in head["history"] if "loss" in h] == by_hand[:5] and head["steps"] == 5
    stopped = fit(config, tc.replace(log_every=1), task, progress=False, checkpoints=False,
                  on_log=lambda rows: rows[-1]["step"] >= 3)
    assert stopped["steps"] == 3 and [h["step"] for h in stopped["history"]] == [1, 2, 3]
    with pytest.raises(ValueError, match="checkpoints=False"):
        fit(config, tc, task, progress=False)


def test_fit_times_the_device_wait_of_asynchronous_updates(monkeypatch):
    """Dispatch returns before the device finishes, so fit's windows must end after the metrics
    fetch, which waits for the pending updates. A fake clock that advances 1 s only while metrics
    are fetched (all device time, none on the host): every timed window holds its fetch's second."""
    import types

    from jaxgpt.train import loop

    clock = [0.0]
    real_get = jax.device_get

    def waiting_get(x):
        clock[0] += 1.0
        return real_get(x)

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(loop.jax, "device_get", waiting_get)
    config = get_preset("seed-minigpt").replace(n_layer=1, d_model=32, d_ff=64)
    tc = TrainConfig(steps=9, batch_size=4, seq_len=16, log_every=4, eval_every=0, val_fraction=0.0)
    task = load_task(config, tc, corpus="seed-synthetic")
    config = fit_config(config, task)
    r = loop.fit(config, tc, task, progress=False, checkpoints=False)
    assert r["train_s"] == 3.0  # the fetches after updates 2-4, 5-8 and 9 (update 1 is the compile window)
    assert r["ms_per_step"] == pytest.approx(1000 / 3)  # the median of 1 s / 3, 1 s / 4, 1 s / 1


def test_fit_without_checkpoints_stops_at_a_nonfinite_loss(monkeypatch):
    from jaxgpt.train.loop import NonFiniteLoss, fit

    _no_orbax(monkeypatch)
    _poisoning(monkeypatch)
    config = get_preset("seed-minigpt").replace(n_layer=1, d_model=32, d_ff=64)
    tc = TrainConfig(steps=12, batch_size=4, seq_len=16, log_every=5, eval_every=0, eval_batches=1)
    task = _poisoned_task(load_task(config, tc, corpus="seed-synthetic"), bad_step=6)  # update 7
    logged = []
    with pytest.raises(NonFiniteLoss, match=r"^non-finite loss at step 7 .*\(no checkpoints kept \(checkpoints=False\)\)"):
        fit(fit_config(config, task), tc, task, progress=False, checkpoints=False, on_log=logged.extend)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]  # the rows after the NaN never reach the callback


# --- progress display (tqdm) ------------------------------------------------------------------------------------

def test_progress_is_plain_lines_off_a_terminal_and_tqdm_on_one():
    import io

    from jaxgpt.train.loop import Progress

    log = io.StringIO()
    bar = Progress(100, stream=log, interval=3600.0)
    for step in (10, 20, 30, 100):
        bar.update(step, 1.23456, 21_700.0)
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2  # the first and the last: at most one per interval
    assert lines[0].startswith(" 10% 10/100 [00:00<?") and "loss 1.2346, 21.7k tok/s" in lines[0]
    assert lines[1].startswith("100% 100/100 [")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = Progress(100, stream=term)
    bar.update(10, 2.0, 1000.0)
    bar.update(50, 1.5, 2000.0)
    bar.close()
    assert "\r" in term.getvalue() and "50/100" in term.getvalue() and "loss 1.5000, 2.0k tok/s" in term.getvalue()
