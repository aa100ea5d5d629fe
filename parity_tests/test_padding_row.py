"""ModelConfig.pad_token_id: the padding token's embedding row gets no gradient from the lookup, as torch's
nn.Embedding(padding_idx) (and so HF LLaMA / Mistral / Qwen2 / Mixtral / Qwen2-MoE / BERT) has it; the
forward pass is bit-identical. Gradients against torch_ref (nn.Embedding(padding_idx)) at 1e-5, and
``jaxgpt parity --grads`` against transformers on directories with pad_token_id=0."""
import jax
import numpy as np
import pytest
import torch

from parity_tests import hf_dirs
from conftest import assert_grads_close, load_into, randomize, torch_grads
from jaxgpt.config import ModelConfig
from jaxgpt.convert import load_hf, save_hf
from jaxgpt.models import build, init_params
from torch_ref import build as tbuild

TOKENS = np.array([[0, 5, 3, 0, 7, 2], [4, 0, 0, 1, 6, 0]], np.int32)  # the padding id 0 in both rows


def _loss_jax(config, params):
    logits = build(config).apply({"params": params}, TOKENS)
    return -jax.nn.log_softmax(logits[:, :-1])[..., 1].sum()  # any loss that reaches every position


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padding_row_has_no_lookup_gradient_like_torch(tied):
    cfg = ModelConfig(vocab_size=12, d_model=16, n_layer=1, n_head=2, max_len=8, pos="rope", tie_embeddings=tied,
                      pad_token_id=0)
    params = randomize(init_params(cfg, jax.random.PRNGKey(0)))
    plain = cfg.replace(pad_token_id=None)
    # self-consistency: the forward pass is the same bits; only the gradient of row 0 changes
    np.testing.assert_array_equal(build(cfg).apply({"params": params}, TOKENS),
                                  build(plain).apply({"params": params}, TOKENS))
    g = jax.grad(lambda p: _loss_jax(cfg, p))(params)
    g_plain = jax.grad(lambda p: _loss_jax(plain, p))(params)
    rows = np.asarray(g["tok_embed"]["embedding"])
    assert np.abs(np.asarray(g_plain["tok_embed"]["embedding"])[0]).max() > 1e-3  # the row would be trained
    if not tied:
        assert not rows[0].any()
    np.testing.assert_array_equal(rows[1:], np.asarray(g_plain["tok_embed"]["embedding"])[1:])
    # parity: torch_ref's nn.Embedding(padding_idx=0); tied, row 0 still gets the head's gradient
    t = load_into(tbuild(cfg), params, ("layers",))
    assert t.tok_embed.padding_idx == 0
    logits = t(torch.from_numpy(TOKENS).long())
    (-torch.log_softmax(logits[:, :-1], -1)[..., 1].sum()).backward()
    assert_grads_close(g, torch_grads(t, params, ("layers",)), f"pad_token_id row gradient ({'tied' if tied else 'untied'})")


def test_pad_token_id_must_be_a_token():
    with pytest.raises(ValueError, match=r"pad_token_id=12 is not a token id in \[0, 12\)"):
        ModelConfig(vocab_size=12, pad_token_id=12)


def test_hf_directories_keep_pad_token_id_both_ways(tmp_path):
    """Import reads config.json's pad_token_id (a negative one counts from the end, as torch reads it);
    export writes it back."""
    import json

    path = hf_dirs.llama_dir(tmp_path / "llama", pad_token_id=0, n_layer=1)
    config, params = load_hf(path)
    assert config.pad_token_id == 0
    save_hf(tmp_path / "out", config, params)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == 0
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, "pad_token_id": -1}))
    assert load_hf(path)[0].pad_token_id == hf_dirs.VOCAB - 1


def test_gpt2_export_refuses_a_padding_row():
    from jaxgpt import PRESETS
    from jaxgpt.convert import gpt2

    cfg = PRESETS["gpt2-small"].replace(vocab_size=48, d_model=32, n_head=4, n_layer=1, max_len=16, pad_token_id=0)
    with pytest.raises(ValueError, match=r"pad_token_id=0 \(HF GPT-2 needs None \(its wte has no padding row"):
        gpt2.config_to_hf(cfg)


def _parity(path):
    from jaxgpt.tools.parity import format_table, run

    report = run(path, grads=True, generate=0)
    assert report["ok"] and not report["grads"]["over_tol"], format_table(report)
    assert report["grads"]["notes"] == []  # nothing left that torch freezes and jaxgpt trains
    assert report["grads"]["params"]["tok_embed/embedding"]["scaled"] <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parity_grads_pass_with_pad_token_id(family, tmp_path):
    """``jaxgpt parity --grads`` on HF LLaMA and Qwen2 directories with pad_token_id=0: every gradient,
    the padded embedding row included, within 1e-5 of transformers (it failed with 7e-1 before)."""
    _parity(hf_dirs.llama_dir(tmp_path / family, pad_token_id=0, family=family))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_parity_grads_pass_with_pad_token_id_moe(family, tmp_path):
    build_dir = hf_dirs.mixtral_dir if family == "mixtral" else hf_dirs.qwen2_moe_dir
    _parity(build_dir(tmp_path / family, pad_token_id=0))
