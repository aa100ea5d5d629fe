"""BertClassifier: jaxgpt vs torch_ref (forward + every gradient), vs Hugging Face BERT (import and
export), and vs the genuine seed 004 MiniBert executed from the seed's own source."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import SHARED, assert_close, check_module, load_into, randomize, require_module, require_shared
from jaxgpt.config import PRESETS, BertConfig, ModelConfig
from jaxgpt.convert import from_seed_minibert
from jaxgpt.convert import from_hf, to_hf
from jaxgpt.models import count_params
from jaxgpt.models.bert import BertClassifier, BertOutput
from torch_ref.models.bert import BertClassifier as TBertClassifier

STACKED = ("layers",)
SEED_004 = SHARED / "seeds" / "004_eaf793378c12c25d.cells.txt"
_TINY = dict(vocab_size=50, d_model=32, n_layer=2, n_head=4, d_ff=64, max_len=16, pos="learned", norm="layernorm",
             mlp="gelu", mlp_bias=True, qkv_bias=True, o_bias=True)
MINIBERT = BertConfig(ModelConfig(**_TINY, norm_eps=1e-5), n_classes=3)  # seed layout: Pre-LN + final norm
BERT = BertConfig(ModelConfig(**_TINY, norm_eps=1e-12, norm_placement="post", final_norm=False, dropout=0.1,
                              attn_dropout=0.1), n_classes=3, type_vocab_size=2, embed_norm=True, pooler="tanh")


def batch(seed=0, b=3, t=9, vocab=50):
    """ids (B, T), padding mask (B, T) with rows fully / partly / mostly padded, token types (B, T)."""
    r = np.random.default_rng(seed)
    ids = r.integers(0, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    types = (np.arange(t) >= t // 2).astype(np.int32)[None].repeat(b, 0) * mask
    return ids, mask, types


def init_params(config, seed=0):
    ids, mask, types = batch()
    model = BertClassifier(config)
    tt = types if config.type_vocab_size else None
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, mask, tt))  # trace, no compile
    return randomize(shapes["params"], seed)


@pytest.mark.parametrize("name,config", [("MiniBERT", MINIBERT), ("BERT", BERT)])
def test_bert_matches_torch_ref(name, config):
    """Forward, attention weights and every gradient: 1e-5 vs torch_ref float32, and vs torch_ref in
    float64 on the same weights, jaxgpt's float32 error <= max(1e-5, K64 x torch_ref float32's own)
    (check_module; margins in docs/parity-margins.md: the direct errors stay under 1.4e-6)."""
    ids, mask, types = batch()
    params = init_params(config)
    tt = types if config.type_vocab_size else None
    check_module(f"Bert {name}", BertClassifier(config), TBertClassifier(config), [ids, mask, tt], params=params,
                 stacked=STACKED, grad_inputs=False)
    # Per-layer attention weights agree too, and padded keys get exactly zero weight.
    out = BertClassifier(config).apply({"params": params}, ids, mask, tt, return_weights=True)
    tout = load_into(TBertClassifier(config), params, STACKED)
    tw = tout.eval()(torch.from_numpy(ids), torch.from_numpy(mask),
                     None if tt is None else torch.from_numpy(tt), return_weights=True)
    assert isinstance(out, BertOutput) and out.attn_weights.shape == (2, 3, 4, 9, 9)
    assert_close(out.attn_weights, tw.attn_weights, f"Bert {name} attention weights")
    assert float(jnp.abs(out.attn_weights[:, 2, :, :, 2:]).max()) == 0.0


def test_padding_mask_hides_padded_tokens():
    ids, mask, types = batch()
    params = init_params(BERT)
    run = lambda i, m: np.asarray(BertClassifier(BERT).apply({"params": params}, i, m, types))
    other = np.where(mask == 1, ids, (ids + 7) % 50)  # change only the padded ids
    assert np.abs(run(ids, mask) - run(other, mask)).max() == 0.0
    assert np.abs(run(ids, None)[1:] - run(other, None)[1:]).max() > 1e-3  # without the mask they leak


def test_encode_and_bad_inputs():
    ids, mask, _ = batch()
    params = init_params(MINIBERT)
    h = BertClassifier(MINIBERT).apply({"params": params}, ids, mask, method=BertClassifier.encode)
    assert h.shape == (3, 9, 32)
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        BertClassifier(MINIBERT).apply({"params": params}, ids, mask, np.zeros_like(ids))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 8\)"):
        BertClassifier(MINIBERT).apply({"params": params}, ids, mask[:, :8])
    with pytest.raises(ValueError, match="token id 50"):
        BertClassifier(MINIBERT).apply({"params": params}, np.full_like(ids, 50), mask)


def hf_config(**kw):
    transformers = require_module("transformers")
    base = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=16, type_vocab_size=2, num_labels=3, attn_implementation="eager")
    return transformers, transformers.BertConfig(**{**base, **kw})


def perturb(module, seed=0):
    """Move every torch weight away from its init (LayerNorms off ones/zeros, biases off zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def test_hf_bert_import_matches_transformers():
    transformers, hc = hf_config()
    hf = perturb(transformers.BertForSequenceClassification(hc))
    config, params = from_hf(hf)
    assert config.encoder.norm_eps == 1e-12 and config.pooler == "tanh" and config.n_classes == 3
    ids, mask, types = batch()
    want = hf(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
              token_type_ids=torch.from_numpy(types).long()).logits
    assert_close(BertClassifier(config).apply({"params": params}, ids, mask, types), want, "Bert vs HF logits")
    want0 = hf(input_ids=torch.from_numpy(ids).long()).logits  # defaults: no mask, token types 0
    assert_close(BertClassifier(config).apply({"params": params}, ids), want0, "Bert vs HF logits")

    bare = perturb(transformers.BertModel(hc), seed=1)  # no classifier: compare hidden states
    config, params = from_hf(bare)
    assert "classifier" not in params and "pooler" in params
    want = bare(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                token_type_ids=torch.from_numpy(types).long()).last_hidden_state
    got = BertClassifier(config).apply({"params": params}, ids, mask, types, method=BertClassifier.encode)
    assert_close(got, want, "Bert vs HF hidden states")


def test_hf_bert_export_round_trip():
    require_module("transformers")
    config = BERT.replace(encoder=BERT.encoder.replace(init_std=0.02))
    params = init_params(config, seed=3)
    hf = to_hf(config, params)
    ids, mask, types = batch(seed=1)
    want = BertClassifier(config).apply({"params": params}, ids, mask, types)
    got = hf(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
             token_type_ids=torch.from_numpy(types).long()).logits
    assert_close(want, got, "Bert to HF logits")
    config2, params2 = from_hf(hf)
    assert config2 == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    with pytest.raises(ValueError, match=r"encoder.norm_placement='pre' \(HF BERT needs 'post'\)"):
        to_hf(MINIBERT, init_params(MINIBERT))


def seed_minibert_class():
    """Exec the last BertSelfAttention..MiniBert block of seed 004 and return its MiniBert class."""
    text = require_shared(SEED_004, "seed 004 sources").read_text(encoding="utf-8")
    start = [m.start() for m in re.finditer(r"^class BertSelfAttention\(nn\.Module\):", text, re.M)][-1]
    end = re.compile(r"^(def collate_fn|# ====== 数据预处理|----- )", re.M).search(text, start).start()
    namespace = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "print": lambda *a, **k: None,
                 "__name__": "seed_004"}
    exec(compile(text[start:end], str(SEED_004), "exec"), namespace)
    return namespace["MiniBert"]


def test_seed_minibert_matches_jaxgpt():
    MiniBert = seed_minibert_class()
    torch.manual_seed(0)
    seed = perturb(MiniBert(vocab_size=50, hidden_size=32, num_heads=4, num_layers=2, ffn_size=64, max_len=16,
                            num_classes=3))
    config, params = from_seed_minibert(seed.state_dict(), n_head=4)
    assert config == MINIBERT.replace(encoder=MINIBERT.encoder.replace(dropout=0.1, attn_dropout=0.1))
    ids, mask, _ = batch(seed=2)  # every row keeps real tokens (a fully padded row is NaN in the seed)
    want = seed(torch.from_numpy(ids).long(), torch.from_numpy(mask))
    assert_close(BertClassifier(config).apply({"params": params}, ids, mask), want, "Bert vs seed MiniBert")
    assert_close(BertClassifier(config).apply({"params": params}, ids), seed(torch.from_numpy(ids).long()),
                 "Bert vs seed MiniBert")
    with pytest.raises(ValueError, match="missing keys"):
        from_seed_minibert({k: v for k, v in seed.state_dict().items() if k != "layers.1.norm2.bias"})


@pytest.mark.parametrize("name", ["seed-minibert", "bert-base"])
def test_full_size_presets_shapes_and_parameter_counts(name):
    config = PRESETS[name]
    ids = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    model = BertClassifier(config)
    params = jax.eval_shape(lambda i: model.init(jax.random.PRNGKey(0), i, i), ids)["params"]
    logits = jax.eval_shape(lambda p, i: model.apply({"params": p}, i, i), params, ids)
    assert logits.shape == (2, config.n_classes)
    with torch.device("meta"):  # shapes only: no memory, no init time
        tmodel = TBertClassifier(config)
    assert count_params(params) == sum(p.numel() for p in tmodel.parameters())
    if name == "bert-base":
        transformers, hc = hf_config(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512,
                                     num_labels=2)
        with torch.device("meta"):
            hf = transformers.BertForSequenceClassification(hc)
        assert count_params(params) == sum(p.numel() for p in hf.parameters()) == 109_483_778
