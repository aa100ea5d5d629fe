"""jaxgpt.nnx: the models as Flax NNX modules (flax.nnx.bridge.ToNNX).

References: a transformers LLaMA built here (random unit-scale weights, save_pretrained; 1e-5), the linen
model on the same params (bit for bit), a linen optax loop and jaxgpt.train's own step (the same
optimizer), init_state's weights, and ToNNX's own lazy_init.
"""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from parity_tests import hf_dirs
import jaxgpt.nnx as jnnx
from conftest import SHARED, assert_close, assert_self_consistent, require_module, require_shared
from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig, TrainConfig, get_preset
from jaxgpt.config.moe import MoEConfig
from jaxgpt.convert import load_hf, save_hf
from jaxgpt.inference.generate import generate
from jaxgpt.models import build, init_params
from jaxgpt.train import init_state, make_optimizer, make_train_step
from jaxgpt.train.losses import loss_terms, objective

ROOT = Path(__file__).resolve().parents[1]
GPT = get_preset("gpt2-shakespeare-char").replace(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_len=32,
                                                  dropout=0.1)
LLAMA = get_preset("llama-tiny").replace(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                         max_len=32)
MOE = LLAMA.replace(moe=MoEConfig(n_experts=4, top_k=2, d_ff=12))


def same_bits(a, b) -> bool:
    """Two params trees with the same names, shapes, dtypes and bytes."""
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    return [p for p, _ in fa] == [p for p, _ in fb] and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x).view(np.uint8),
                                                                     np.asarray(y).view(np.uint8))
        for (_, x), (_, y) in zip(fa, fb))


def tiny_bert() -> BertConfig:
    enc = get_preset("seed-minibert").encoder.replace(vocab_size=64, d_model=32, n_layer=1, d_ff=64, max_len=16)
    return BertConfig(enc, n_classes=3)


def tiny_encdec() -> EncDecConfig:
    enc = get_preset("seed-transformer").encoder.replace(vocab_size=64, d_model=32, d_ff=64, max_len=16)
    return EncDecConfig(enc, enc.replace(vocab_size=48))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A transformers LLaMA (GQA, untied) with unit-scale random weights, saved as an HF directory."""
    transformers = require_module("transformers")
    import torch

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))
    hf_dirs.randomize_moe_(hf, seed=1)  # every matrix N(0, 1/fan_in), norms off one: 1e-5 means something
    path = tmp_path_factory.mktemp("nnx") / "llama"
    hf.save_pretrained(path)
    return hf, path


def test_from_hf_matches_linen_bitwise_and_transformers(hf_llama, tmp_path):
    import torch

    hf, path = hf_llama
    config, model = jnnx.from_hf(path)
    _, params = load_hf(path)
    assert jnnx.config_of(model) == config and isinstance(config, ModelConfig)
    ids = np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32)
    got = nnx.jit(lambda m, x: m(x))(model, ids)  # the NNX call: (B, T) ids -> (B, T, vocab) logits
    want = jax.jit(build(config).apply)({"params": params}, ids)
    assert got.shape == (2, 12, 64) and np.array_equal(np.asarray(got), np.asarray(want))  # bit for bit
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert_close(got, ref, "nnx from_hf llama vs transformers")
    # the converters take to_params: written back, the directory's tensors are HF's, bit for bit
    save_hf(tmp_path / "back", config, jnnx.to_params(model))
    assert same_bits(load_hf(tmp_path / "back")[1], params)


def test_generate_takes_to_params(hf_llama):
    _, path = hf_llama
    config, model = jnnx.from_hf(path)
    _, params = load_hf(path)
    prompt = np.random.default_rng(1).integers(3, 64, (2, 5)).astype(np.int32)
    got = np.asarray(generate(config, jnnx.to_params(model), prompt, 6))  # cached, one compiled loop
    assert np.array_equal(got, np.asarray(generate(config, params, prompt, 6)))
    # the module's own call, uncached: every new token is the argmax after its prefix (causal: one call)
    logits = model(got[:, :-1])  # (B, T0 + 5, vocab)
    assert np.array_equal(got[:, 5:], np.asarray(jnp.argmax(logits[:, 4:], -1)))


def test_optimizer_steps_match_linen_loop_and_fit():
    """5 steps of nnx.Optimizer(make_optimizer(tc)) + jaxgpt.nnx.loss, dropout on, against a linen optax loop
    with the same tx and fit's dropout keys (1e-6: two compiled programs may round differently), and against
    jaxgpt.train's step (losses). A weight decay of 1 makes a mask the NNX state misreads show (~1e-4)."""
    config = LLAMA.replace(dropout=0.1)
    tc = TrainConfig(steps=10, lr=1e-3, warmup_steps=2, decay="linear", weight_decay=1.0, batch_size=4, seq_len=8,
                     seed=3)
    model = jnnx.from_config(config, seed=tc.seed)
    state = init_state(config, tc, mesh=None)
    assert same_bits(jnnx.to_params(model), state.params)  # the weights `jaxgpt train --set seed=3` starts from
    params = jax.tree.map(jnp.copy, state.params)  # the train step below donates state
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    optimizer = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)
    fit_step = make_train_step(config, tc, mesh=None)

    @jax.jit
    def linen_step(params, opt_state, batch, rng):
        def mean_loss(p):
            terms = loss_terms(config, p, batch, rng=rng, train=True)
            return terms["loss_sum"] / terms["count"]
        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(jnnx.loss)(model, batch, True)
        optimizer.update(model, grads)
        return loss

    rs = np.random.default_rng(0)
    for step in range(5):
        batch = {k: rs.integers(0, 64, (4, 8)).astype(np.int32) for k in ("x", "y")}
        params, opt_state, want = linen_step(params, opt_state, batch, jax.random.fold_in(state.rng, step))
        got = nnx_step(model, optimizer, batch)
        state, metrics = fit_step(state, jax.tree.map(lambda a: a[None], batch))
        assert_self_consistent(got, want, "nnx optimizer step loss vs linen optax loop", tol=1e-6)
        # fit divides the summed loss's gradient by the count, rounding differently: the losses stay close
        assert_self_consistent(got, metrics["loss"], "nnx optimizer step loss vs jaxgpt.train step", tol=1e-5)
    errs = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), jnnx.to_params(model), params))
    assert len(errs) == len(jax.tree.leaves(params))
    assert_self_consistent(max(errs), 0.0, "nnx optimizer params after 5 steps vs linen optax loop", tol=1e-6)
    assert int(optimizer.step[...]) == 5


@pytest.mark.parametrize("config", [LLAMA, GPT, MOE, tiny_bert(), tiny_encdec()],
                         ids=["llama", "gpt2", "moe", "bert", "encdec"])
def test_params_round_trip_bitwise(config):
    params = init_params(config, jax.random.PRNGKey(7))
    model = jnnx.from_params(config, params)
    assert same_bits(jnnx.to_params(model), params)
    again = jnnx.from_params(config, jnnx.to_params(model))
    assert same_bits(jnnx.to_params(again), params)
    ids = np.random.default_rng(2).integers(0, 48, (2, 6)).astype(np.int32)
    inputs = {BertConfig: (ids, np.ones((2, 6), bool)), EncDecConfig: (ids, ids[:, :5], np.ones((2, 6), bool))}
    args = inputs.get(type(config), (ids,))
    assert np.array_equal(np.asarray(again(*args)), np.asarray(build(config).apply({"params": params}, *args)))
    if config is MOE:  # the loss is fit's objective: cross entropy + the router losses
        batch = {"x": ids, "y": (ids + 1) % 64}
        terms = loss_terms(config, params, batch)
        ce, want = terms["loss_sum"] / terms["count"], objective(terms, TrainConfig(), config) / terms["count"]
        assert float(jnnx.loss(again, batch)) == float(want) and float(want) > float(ce)
    if isinstance(config, BertConfig):  # a linen method through the bridge: the hidden states
        want = build(config).apply({"params": params}, *args, method="encode")
        assert np.array_equal(np.asarray(again.encode(*args)), np.asarray(want))


def test_structure_is_lazy_inits():
    """from_params builds the state ToNNX(...).lazy_init builds from a linen init (the bridge's own route)."""
    lazy = nnx.bridge.ToNNX(build(LLAMA)).lazy_init(jnp.zeros((1, 1), jnp.int32), rngs=jax.random.PRNGKey(0))
    ours = jnnx.from_params(LLAMA, nnx.to_pure_dict(nnx.state(lazy, nnx.Param)))
    assert jax.tree.structure(nnx.state(lazy, nnx.Param)) == jax.tree.structure(nnx.state(ours, nnx.Param))
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    assert np.array_equal(np.asarray(ours(ids)), np.asarray(lazy(ids)))


def test_from_preset_and_refusals():
    config, model = jnnx.from_preset("llama-tiny", vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2,
                                     d_ff=64, max_len=32, seed=1)
    assert config == LLAMA and jnnx.config_of(model) == LLAMA
    assert same_bits(jnnx.to_params(model), init_state(LLAMA, TrainConfig(seed=1), mesh=None).params)
    params = jnnx.to_params(model)
    broken = {**params, "extra": {"scale": jnp.ones(3)}, "norm": {"scale": jnp.ones(5)}}
    del broken["lm_head"]
    with pytest.raises(ValueError, match=r"missing \['lm_head/kernel'\]; unexpected \['extra/scale'\]; "
                                         r"shape mismatches \['norm/scale: got \(5,\), expected \(32,\)'\]"):
        jnnx.from_params(LLAMA, broken)
    with pytest.raises(TypeError, match="expected a module from jaxgpt.nnx"):
        jnnx.to_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))


@pytest.mark.smoke
def test_example_trains():
    text = require_shared(SHARED / "data" / "tinyshakespeare.txt", "tinyshakespeare")
    proc = subprocess.run([sys.executable, "examples/nnx_train.py", "--text", str(text), "--steps", "21"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, proc.stdout
