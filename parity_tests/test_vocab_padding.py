"""A padded vocabulary (ModelConfig.valid_vocab < vocab_size, nanoGPT's 50304 for GPT-2's 50257): the
padded ids' logits are the float32 minimum in jaxgpt and torch_ref alike (logits and gradients at 1e-5
against torch_ref), the loss and its gradient stay finite and equal to the unpadded model's, padded ids
are never sampled, ``--set vocab_size`` pads a training run, and HF export writes the tokens' rows only."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import assert_close, assert_grads_close, load_into, randomize, torch_grads
from jaxgpt import PRESETS
from jaxgpt.config import ModelConfig
from jaxgpt.convert import save_hf
from jaxgpt.inference.generate import generate
from jaxgpt.models import abstract_params, build, init_params
from jaxgpt.train.losses import cross_entropy
from torch_ref import build as tbuild

V, PADDED = 33, 40
TOKENS = np.random.default_rng(0).integers(0, V, (2, 9)).astype(np.int32)


def _config(tied=False, **kw):
    return ModelConfig(vocab_size=PADDED, valid_vocab=V, d_model=16, n_layer=1, n_head=2, max_len=16, pos="rope",
                       tie_embeddings=tied, **kw)


def _loss(config, params):
    logits = build(config).apply({"params": params}, TOKENS[:, :-1])
    return cross_entropy(logits, TOKENS[:, 1:])[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padded_logits_are_masked_like_torch_ref(tied):
    cfg = _config(tied)
    params = randomize(init_params(cfg, jax.random.PRNGKey(0)))
    logits = np.asarray(build(cfg).apply({"params": params}, TOKENS))
    assert (logits[..., V:] == np.finfo(np.float32).min).all() and np.isfinite(logits).all()
    t = load_into(tbuild(cfg), params, ("layers",))
    t_logits = t(torch.from_numpy(TOKENS).long())
    assert_close(logits, t_logits.detach().numpy(), f"padded vocab logits ({'tied' if tied else 'untied'})")
    # the loss and its gradient: finite, and (self-consistency) the unpadded model's on the same weights
    g = jax.grad(lambda p: _loss(cfg, p))(params)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))
    unpadded = cfg.replace(vocab_size=V, valid_vocab=None)
    cut = jax.tree.map(lambda a: a, params)
    cut["tok_embed"]["embedding"] = params["tok_embed"]["embedding"][:V]
    if not tied:
        cut["lm_head"]["kernel"] = params["lm_head"]["kernel"][:, :V]
        assert not np.asarray(g["lm_head"]["kernel"])[:, V:].any()  # the padded columns get no gradient
    assert float(_loss(cfg, params)) == pytest.approx(float(_loss(unpadded, cut)), rel=1e-6)
    assert not np.asarray(g["tok_embed"]["embedding"])[V:].any()  # never looked up, never a probability
    # parity of every gradient against torch_ref's masked logits
    F = torch.nn.functional
    F.cross_entropy(t_logits[:, :-1].reshape(-1, PADDED), torch.from_numpy(TOKENS[:, 1:]).long().reshape(-1),
                    reduction="sum").backward()
    assert_grads_close(g, torch_grads(t, params, ("layers",)), "padded vocab grads")


def test_padded_ids_are_never_sampled_or_accepted():
    cfg = _config()
    params = randomize(init_params(cfg, jax.random.PRNGKey(1)))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"].at[:, V:].set(50.0)  # the padded ids would win
    prompt = TOKENS[:, :3]
    kw = dict(temperature=2.0, rng=jax.random.PRNGKey(0))
    out = np.asarray(generate(cfg, params, prompt, 12, **kw))
    assert out[:, 3:].max() < V
    assert np.asarray(generate(cfg, params, prompt, 12, temperature=0.0))[:, 3:].max() < V  # greedy too
    # the same weights without the mask emit padded ids: the check above can fail
    assert np.asarray(generate(cfg.replace(valid_vocab=None), params, prompt, 12, **kw))[:, 3:].max() >= V
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 33\)"):
        build(cfg).apply({"params": params}, np.array([[1, V]], np.int32))  # a padded id is not an input
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 33\)"):
        generate(cfg, params, np.array([[1, V]], np.int32), 2)  # nor a prompt (checked before jit)


def test_gpt2_shapes_with_a_padded_vocabulary():
    cfg = PRESETS["gpt2-small"].replace(vocab_size=50304, valid_vocab=50257)
    assert abstract_params(cfg)["tok_embed"]["embedding"].shape == (50304, 768)
    ids = jnp.zeros((1, 8), jnp.int32)
    loss = jax.eval_shape(lambda p: cross_entropy(build(cfg).apply({"params": p}, ids), ids)[0], abstract_params(cfg))
    assert loss.shape == () and loss.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"valid_vocab=50304 must be in \(0, vocab_size=50304\)"):
        cfg.replace(valid_vocab=50304)


def test_hf_export_writes_the_tokens_rows(tmp_path):
    """save_hf of a padded GPT-2: config.json and the tables have valid_vocab rows, and transformers'
    logits are jaxgpt's for every token."""
    import transformers

    cfg = PRESETS["gpt2-small"].replace(vocab_size=PADDED, valid_vocab=V, d_model=32, n_head=4, n_layer=1,
                                        max_len=16, dropout=0.0)
    params = randomize(init_params(cfg, jax.random.PRNGKey(2)))
    save_hf(tmp_path / "hf", cfg, params)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == V
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    want = hf(torch.from_numpy(TOKENS).long()).logits.detach().numpy()
    got = np.asarray(build(cfg).apply({"params": params}, TOKENS))
    assert want.shape[-1] == V
    assert_close(got[..., :V], want, "padded GPT-2 exported to HF: logits")


def test_fit_config_pads_only_when_asked():
    from jaxgpt.data import CharTokenizer
    from jaxgpt.data.tasks import fit_config

    class Task:
        tokenizer = CharTokenizer("abcdefg")

    base = ModelConfig(vocab_size=256)
    assert fit_config(base, Task).vocab_size == 7 and fit_config(base, Task).valid_vocab is None
    padded = fit_config(base, Task, vocab_size=64)
    assert (padded.vocab_size, padded.valid_vocab) == (64, 7)
    assert fit_config(padded, Task) == padded  # resuming / fine-tuning keeps the padding
    with pytest.raises(ValueError, match="vocab_size=5 is smaller than the data's vocabulary"):
        fit_config(base, Task, vocab_size=5)


@pytest.mark.e2e  # a jaxgpt train run
def test_train_with_set_vocab_size_pads_the_run(tmp_path, capsys):
    from jaxgpt.cli import main
    from jaxgpt.train.checkpoint import Checkpoints

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 80)
    run = tmp_path / "run"
    assert main(["train", "--preset", "seed-minigpt", "--data", str(text), "--out", str(run), "--quiet",
                 "--set", "vocab_size=64", "--set", "n_layer=1", "--set", "steps=3", "--set", "batch_size=4",
                 "--set", "seq_len=16"]) == 0
    config, params, _ = Checkpoints(run, create=False).restore_params()
    assert (config.vocab_size, config.valid_vocab) == (64, len(set(text.read_text())))
    out = np.asarray(generate(config, params, np.array([[1, 2]]), 16, temperature=5.0, rng=jax.random.PRNGKey(0)))
    assert out.max() < config.valid_vocab
