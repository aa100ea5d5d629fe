"""The layer variants of issue 53's newer HF families, vs torch_ref (forward and every gradient, 1e-5,
and the float64 twin: conftest.check_module) and vs transformers' own modules where one is cheap to
build: q/k RMSNorm per head (Qwen3) and over the projection (OLMo 2), partial rotary (GPT-NeoX, Phi),
the norm inside the residual (OLMo 2's post_sublayer) and the parallel residual (GPT-NeoX), plus
KV-cached decoding with the q/k norm and partial rotary == the full causal forward."""
import numpy as np
import pytest
import torch

from conftest import assert_close, assert_self_consistent, check_module, random_params, require_module
from jaxgpt.config import ModelConfig
from jaxgpt.nn.attention import Attention, KVCache
from jaxgpt.nn.block import Block
from jaxgpt.nn.positions import apply_rope
from torch_ref.nn.block import Block as TBlock

transformers = require_module("transformers", allow_module_level=True)  # CI=true: missing is a failure
VARIANTS = {
    "qk_norm head": dict(qk_norm="head", d_head=12, n_kv_head=2),
    "post_sublayer, qk_norm full": dict(norm_placement="post_sublayer", qk_norm="full", n_kv_head=2),
    "parallel, rotary_dim": dict(parallel_residual=True, norm="layernorm", mlp="gelu", rotary_dim=6, qkv_bias=True,
                                 mlp_bias=True, o_bias=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_block_variant_matches_torch_ref(name, rng):
    cfg = ModelConfig(d_model=32, n_head=4, pos="rope", **VARIANTS[name])
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    params = check_module(f"Block {name}", Block(cfg), TBlock(cfg), [x], select=lambda o: o[0], direct_grads=False)
    if cfg.qk_norm:
        width = cfg.head_dim if cfg.qk_norm == "head" else cfg.n_head * cfg.head_dim
        assert params["attn"]["q_norm"]["scale"].shape == (width,)


def _hf_attention_inputs(module_cls, rotary_cls, hf_config, x):
    """transformers' attention module (eager), unit-scale weights, and its output on x with a causal mask."""
    att = module_cls(hf_config, layer_idx=0).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]) + (p if p.ndim == 1 else 0))
    t = x.shape[1]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        y = att(torch.from_numpy(x), position_embeddings=rotary_cls(hf_config)(torch.from_numpy(x), pos),
                attention_mask=mask)[0]
    return att, y


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_qk_norm_attention_matches_transformers(family, rng):
    """Qwen3Attention (q/k norm per head, explicit head_dim) and Olmo2Attention (over the projection)."""
    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                 attn_implementation="eager")
    if family == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m
        hf_config, classes, kind = transformers.Qwen3Config(**sizes, head_dim=16), (m.Qwen3Attention,
                                                                                     m.Qwen3RotaryEmbedding), "head"
    else:
        from transformers.models.olmo2 import modeling_olmo2 as m
        hf_config, classes, kind = transformers.Olmo2Config(**sizes), (m.Olmo2Attention, m.Olmo2RotaryEmbedding), "full"
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    att, want = _hf_attention_inputs(*classes, hf_config, x)
    head_dim = getattr(hf_config, "head_dim", None) or 8
    ours = Attention(d_model=32, n_head=4, n_kv_head=2, head_dim=head_dim, rope=True, qk_norm=kind, norm_eps=1e-5)
    template = random_params(ours, x)
    sd = {k.replace("_norm.weight", "_norm.scale"): v for k, v in att.state_dict().items()}
    from jaxgpt.core.layout import state_dict_to_params

    params = state_dict_to_params(sd, template)
    assert_close(ours.apply({"params": params}, x, is_causal=True)[0], want, f"{family} attention vs transformers")


def test_partial_rotary_matches_gpt_neox(rng):
    """apply_rope(rotary_dim=...) == GPTNeoX's rotary embedding on a quarter of each head (rotary_pct 0.25)."""
    from transformers.models.gpt_neox import modeling_gpt_neox as m

    cfg = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=2, rotary_pct=0.25, rotary_emb_base=500.0)
    q = rng.standard_normal((2, 9, 2, 32)).astype(np.float32)  # (B, T, H, D)
    pos = torch.arange(3, 12)[None]
    cos, sin = m.GPTNeoXRotaryEmbedding(cfg)(torch.from_numpy(q), pos)
    want, _ = m.apply_rotary_pos_emb(torch.from_numpy(q).transpose(1, 2), torch.from_numpy(q).transpose(1, 2), cos, sin)
    got = apply_rope(q, np.arange(3, 12), base=500.0, rotary_dim=8)
    assert_close(got, want.transpose(1, 2), "partial rotary vs GPT-NeoX")
    assert np.array_equal(np.asarray(got)[..., 8:], q[..., 8:])  # the other dims pass through unchanged


def test_cached_decoding_with_qk_norm_and_partial_rotary(rng, kind="head"):
    """Prefill + one token at a time through a KVCache == the uncached causal forward (self-consistency;
    'full' runs through the paged engine in test_hf_famb.py's OLMo 2 check)."""
    att = Attention(d_model=32, n_head=4, n_kv_head=2, rope=True, rotary_dim=4, qk_norm=kind)
    x = rng.standard_normal((1, 7, 32)).astype(np.float32)
    p = random_params(att, x)
    full = np.asarray(att.apply({"params": p}, x, is_causal=True)[0])
    cache = KVCache.init(1, 2, 8, 8)
    y, cache, _ = att.apply({"params": p}, x[:, :4], is_causal=True, cache=cache)
    steps = [y]
    for i in range(4, 7):
        y, cache, _ = att.apply({"params": p}, x[:, i:i + 1], is_causal=True, cache=cache)
        steps.append(y)
    assert_self_consistent(np.concatenate(steps, 1), full, f"qk_norm={kind} cached decode")


def test_config_refuses_inexact_variants():
    with pytest.raises(ValueError, match="rotary_dim=6 needs pos='rope'"):
        ModelConfig(d_model=32, n_head=4, pos="learned", rotary_dim=6)
    with pytest.raises(ValueError, match="rotary_dim=12 .* head_dim=8"):
        ModelConfig(d_model=32, n_head=4, pos="rope", rotary_dim=12)
    with pytest.raises(ValueError, match="parallel_residual=True needs norm_placement='pre'"):
        ModelConfig(d_model=32, n_head=4, parallel_residual=True, norm_placement="post")
    with pytest.raises(ValueError, match="qk_norm='rms' is not one of"):
        ModelConfig(qk_norm="rms")


def test_parallel_residual_differs_from_sequential(rng):
    """The two residual wirings are different functions on the same weights (the flag is not ignored)."""
    cfg = ModelConfig(d_model=32, n_head=4, pos="rope", parallel_residual=True)
    x = rng.standard_normal((1, 5, 32)).astype(np.float32)
    p = random_params(Block(cfg), x)
    a = Block(cfg).apply({"params": p}, x)[0]
    b = Block(cfg.replace(parallel_residual=False)).apply({"params": p}, x)[0]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
