"""EncoderDecoder: jaxgpt vs torch_ref (forward + every gradient) with a partly padded source,
masking and causality properties, the full-size preset, and the genuine seed 004 Transformer."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import SHARED, assert_close, check_module, load_into, randomize, require_shared
from jaxgpt.config import PRESETS, EncDecConfig, ModelConfig
from jaxgpt.models import count_params
from jaxgpt.convert import params_to_state_dict, state_dict_to_params
from jaxgpt.models.encdec import STACKED, EncoderDecoder
from torch_ref.models.encdec import EncoderDecoder as TEncoderDecoder

SEED_004 = SHARED / "seeds" / "004_eaf793378c12c25d.cells.txt"
_SEED = PRESETS["seed-transformer"]
# Seed layout (Post-LN, sqrt(d)-scaled embeddings, sinusoidal positions, ReLU), tiny.
SEEDLIKE = EncDecConfig(_SEED.encoder.replace(vocab_size=40, d_model=32, n_layer=2, d_ff=64, max_len=16),
                        _SEED.decoder.replace(vocab_size=30, d_model=32, n_layer=2, d_ff=64, max_len=16))
# Pre-LN with final norms, learned positions, GELU, unequal depths, no output bias.
_PRE = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, d_ff=64, max_len=16, pos="learned",
                   norm="layernorm", mlp="gelu", mlp_bias=True, qkv_bias=True, o_bias=True)
PRELN = EncDecConfig(_PRE, _PRE.replace(vocab_size=30, n_layer=3, n_head=2), out_bias=False)


def batch(seed=0, b=3, s=9, t=7, src_vocab=40, tgt_vocab=30):
    """src (B, S), tgt (B, T) ids and a source mask (B, S): full, partly and mostly padded rows."""
    r = np.random.default_rng(seed)
    src = r.integers(0, src_vocab, (b, s)).astype(np.int32)
    tgt = r.integers(0, tgt_vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, s), bool)
    mask[1, 5:] = False
    mask[2, 2:] = False
    return src, tgt, mask


def init_params(config, seed=0):
    src, tgt, mask = batch()
    shapes = jax.eval_shape(lambda: EncoderDecoder(config).init(jax.random.PRNGKey(0), src, tgt, mask))
    return randomize(shapes["params"], seed)


def load(tmodel, params):
    return load_into(tmodel, params, STACKED).eval()


@pytest.mark.parametrize("name,config", [("seed-like", SEEDLIKE), ("pre-LN", PRELN)])
def test_encdec_matches_torch_ref(name, config):
    """Forward: 1e-5 vs torch_ref float32. Forward and every gradient: vs torch_ref in float64 on
    the same weights, jaxgpt's float32 error <= max(1e-5, K64 x torch_ref float32's own)
    (conftest's check_module, direct_grads=False): the float32-vs-float32 gradient error is 6.1e-6
    here (up to 8.2e-6 over 20 weight draws) and was 1.003e-5 on an AMD EPYC (issue #18), rounding
    alone; docs/parity-margins.md."""
    src, tgt, mask = batch()
    params = init_params(config)
    assert EncoderDecoder(config).apply({"params": params}, src, tgt, mask).shape == (3, 7, 30)
    check_module(f"EncDec {name}", EncoderDecoder(config), TEncoderDecoder(config), [src, tgt, mask],
                 params=params, stacked=STACKED, grad_inputs=False, direct_grads=False)


def test_encode_decode_masking_and_causality():
    src, tgt, mask = batch(seed=1)
    params = init_params(SEEDLIKE, seed=2)
    model = EncoderDecoder(SEEDLIKE)
    run = lambda s, t, m: np.asarray(model.apply({"params": params}, s, t, m))
    full = run(src, tgt, mask)
    memory = model.apply({"params": params}, src, mask, method=EncoderDecoder.encode)
    assert memory.shape == (3, 9, 32)
    parts = model.apply({"params": params}, tgt, memory, mask, method=EncoderDecoder.decode)
    assert np.abs(np.asarray(parts) - full).max() == 0.0
    other_src = np.where(mask, src, (src + 5) % 40)  # padded source tokens are invisible
    assert np.abs(run(other_src, tgt, mask) - full).max() == 0.0
    assert np.abs(run(other_src, tgt, None)[1:] - run(src, tgt, None)[1:]).max() > 1e-3
    later = tgt.copy()
    later[:, 4:] = (later[:, 4:] + 3) % 30  # the decoder is causal: earlier logits do not move
    changed = run(src, later, mask)
    assert np.abs(changed[:, :4] - full[:, :4]).max() == 0.0 and np.abs(changed[:, 4:] - full[:, 4:]).max() > 1e-3
    with pytest.raises(ValueError, match="token id 40"):
        run(np.full_like(src, 40), tgt, mask)


def test_seed_transformer_preset_shapes_and_parameter_count():
    src, tgt = jax.ShapeDtypeStruct((2, 10), jnp.int32), jax.ShapeDtypeStruct((2, 8), jnp.int32)
    model = EncoderDecoder(_SEED)
    params = jax.eval_shape(lambda s, t: model.init(jax.random.PRNGKey(0), s, t), src, tgt)["params"]
    assert jax.eval_shape(lambda p, s, t: model.apply({"params": p}, s, t), params, src, tgt).shape == (2, 8, 8000)
    tmodel = TEncoderDecoder(_SEED)
    assert count_params(params) == sum(p.numel() for p in tmodel.parameters())
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), params)
    assert set(params_to_state_dict(zeros, stacked=STACKED)) == set(tmodel.state_dict())


# seed 004 Transformer module names -> torch_ref EncoderDecoder names.
_SEED_NAMES = [(r"^encoder_embedding\.lut\.", "encoder.tok_embed."),
               (r"^decoder_embedding\.lut\.", "decoder.tok_embed."), (r"^(en|de)coder_layers\.", r"\1coder.layers."),
               (r"\.(attention|masked_self_attention)\.", ".attn."),
               (r"\.cross_attention\.", ".cross_attn."), (r"\.W_q\.", ".q_proj."), (r"\.W_k\.", ".k_proj."),
               (r"\.W_v\.", ".v_proj."), (r"\.W_o\.", ".o_proj."), (r"\.ffn\.linear1\.", ".mlp.fc_in."),
               (r"\.ffn\.linear2\.", ".mlp.fc_out."), (r"^linear_out\.", "out_proj.")]


def seed_state_dict_to_ours(sd):
    out = {}
    for key, v in sd.items():
        if key.endswith("pos_encoding.pe"):
            continue  # a buffer: the same sinusoidal table jaxgpt computes
        decoder = key.startswith("decoder_layers.")
        for pat, rep in _SEED_NAMES:
            key = re.sub(pat, rep, key)
        norms = {"norm1": "attn_norm", "norm2": "cross_norm" if decoder else "mlp_norm", "norm3": "mlp_norm"}
        key = re.sub(r"\.(norm\d)\.weight$", lambda m: f".{norms[m.group(1)]}.scale", key)  # noqa: B023 - called in this iteration
        key = re.sub(r"\.(norm\d)\.bias$", lambda m: f".{norms[m.group(1)]}.bias", key)  # noqa: B023 - called in this iteration
        out[key] = v
    return out


def test_seed_transformer_matches_jaxgpt():
    text = require_shared(SEED_004, "seed 004 sources").read_text(encoding="utf-8")
    start = text.index("def get_attention_mask", text.index("### 标准Transformer架构"))
    end = text.index('if __name__ == "__main__":', start)
    ns = {"torch": torch, "nn": torch.nn, "math": __import__("math"), "print": lambda *a, **k: None}
    exec(compile(text[start:end], str(SEED_004), "exec"), ns)
    torch.manual_seed(0)
    seed = ns["Transformer"](40, 30, d_model=32, num_heads=4, d_ff=64, num_layers=2).eval()
    with torch.no_grad():
        for p in seed.parameters():  # norms off ones/zeros, biases off zero; keeps logits unit-scale
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    config = SEEDLIKE
    params = state_dict_to_params(seed_state_dict_to_ours(seed.state_dict()), init_params(config), stacked=STACKED)
    src, tgt, _ = batch(seed=3)
    want = seed(torch.from_numpy(src).long(), torch.from_numpy(tgt).long())
    assert_close(EncoderDecoder(config).apply({"params": params}, src, tgt), want, "EncDec vs seed Transformer")
