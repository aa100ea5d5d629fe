"""Named configurations: the seeds' models, GPT-2, LLaMA, Gemma and BERT sizes (values, no framework)."""
from __future__ import annotations

from typing import Any

from jaxgpt.config.model import FLOAT32_EPS, BertConfig, EncDecConfig, ModelConfig
from jaxgpt.config.rope import RopeScaling


def _gpt2(d_model: int, n_layer: int, n_head: int, **kw: Any) -> ModelConfig:
    base = dict(vocab_size=50257, max_len=1024, d_model=d_model, n_layer=n_layer, n_head=n_head, pos="learned",
                norm="layernorm", norm_eps=1e-5, mlp="gelu_tanh", mlp_bias=True, qkv_bias=True, o_bias=True,
                tie_embeddings=True, dropout=0.1, attn_dropout=None, scale_out_init=True)
    return ModelConfig(**{**base, **kw})


def _llama(vocab_size: int, d_model: int, n_layer: int, n_head: int, n_kv_head: int, d_ff: int, max_len: int,
           **kw: Any) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=vocab_size, d_model=d_model, n_layer=n_layer, n_head=n_head,
                                 n_kv_head=n_kv_head, d_ff=d_ff, max_len=max_len, pos="rope", rope_layout="half",
                                 norm="rmsnorm", norm_eps=1e-6, mlp="swiglu"), **kw})


def _llama3(d_model: int, n_layer: int, n_head: int, d_ff: int, factor: float, tie: bool) -> ModelConfig:
    """Meta's Llama 3.1 / 3.2 configs: 128K context stretched from 8K by llama3 RoPE scaling, 8 KV heads."""
    scaling = RopeScaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    return _llama(128256, d_model, n_layer, n_head, 8, d_ff, 131072, rope_base=500000.0, rope_scaling=scaling,
                  norm_eps=1e-5, tie_embeddings=tie)


def _gemma(d_model: int, n_layer: int, n_head: int, n_kv_head: int, d_ff: int, **kw: Any) -> ModelConfig:
    return _llama(256000, d_model, n_layer, n_head, n_kv_head, d_ff, 8192, d_head=256, mlp="geglu_tanh",
                  norm_unit_offset=True, embed_scale=True, tie_embeddings=True, pad_token_id=0, **kw)


# Seed 000's MiniGPT: sinusoidal positions, RMSNorm (eps 1e-6), Pre-LN, SwiGLU, untied head.
_SEED_MINIGPT = ModelConfig(vocab_size=128, d_model=64, n_head=4, n_layer=4, d_ff=256, max_len=256,
                            pos="sinusoidal", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu")
# Seed 002's translation LM: no positions, torch nn.RMSNorm default eps, exact GELU 4x MLP, no biases.
_SEED_ATTNRES = ModelConfig(vocab_size=147, d_model=128, n_head=4, n_layer=6, d_ff=512, max_len=128, pos="none",
                            norm="rmsnorm", norm_eps=FLOAT32_EPS, mlp="gelu")
# Seed 004's MiniBERT encoder: learned positions, Pre-LN, final LayerNorm, exact GELU, biases everywhere.
_SEED_MINIBERT = ModelConfig(vocab_size=30522, d_model=128, n_head=4, n_layer=2, d_ff=256, max_len=256,
                             pos="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu", mlp_bias=True,
                             qkv_bias=True, o_bias=True, dropout=0.1, attn_dropout=0.1)
_BERT_BASE = ModelConfig(vocab_size=30522, d_model=768, n_head=12, n_layer=12, d_ff=3072, max_len=512,
                         pos="learned", norm="layernorm", norm_eps=1e-12, mlp="gelu", mlp_bias=True, qkv_bias=True,
                         o_bias=True, norm_placement="post", final_norm=False, dropout=0.1, attn_dropout=0.1)
# Seed 004's encoder-decoder demo: sqrt(d)-scaled embeddings, sinusoidal positions, Post-LN, ReLU FFN.
_SEED_ENCDEC = ModelConfig(vocab_size=10000, d_model=64, n_head=4, n_layer=1, d_ff=256, max_len=512,
                           pos="sinusoidal", norm="layernorm", norm_eps=1e-5, mlp="relu", mlp_bias=True,
                           qkv_bias=True, o_bias=True, norm_placement="post", final_norm=False, embed_scale=True)

PRESETS: dict[str, ModelConfig | BertConfig | EncDecConfig] = {
    "seed-minigpt": _SEED_MINIGPT,
    "seed-minigpt-nopos": _SEED_MINIGPT.replace(pos="none"),
    "seed-minigpt-postln": _SEED_MINIGPT.replace(norm_placement="post"),
    "seed-minigpt-relu": _SEED_MINIGPT.replace(mlp="relu", mlp_bias=True),
    "gpt2-small": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    # Seed 003 / nanoGPT shakespeare-char: nanoGPT and the seed use torch's exact nn.GELU.
    "gpt2-shakespeare-char": _gpt2(384, 6, 6, vocab_size=65, max_len=256, mlp="gelu", dropout=0.2),
    "llama-tiny": _llama(512, 256, 4, 8, 2, 688, 512),
    "llama-small": _llama(32000, 768, 12, 12, 4, 2048, 2048),
    "llama-1b": _llama(128256, 2048, 16, 32, 8, 8192, 8192, rope_base=500000.0, tie_embeddings=True),
    "llama3.2-1b": _llama3(2048, 16, 32, 8192, 32.0, tie=True),
    "llama3.2-3b": _llama3(3072, 28, 24, 8192, 32.0, tie=True),
    "llama3.1-8b": _llama3(4096, 32, 32, 14336, 8.0, tie=False),
    # The shapes of Hugging Face checkpoints (weights come from load_hf): Qwen/Qwen3-0.6B, allenai/OLMo-2-0425-1B,
    # EleutherAI/pythia-160m, microsoft/Phi-3-mini-4k-instruct.
    "qwen3-0.6b": _llama(151936, 1024, 28, 16, 8, 3072, 40960, d_head=128, qk_norm="head", rope_base=1000000.0,
                         tie_embeddings=True),
    "olmo2-1b": _llama(100352, 2048, 16, 16, 16, 8192, 4096, qk_norm="full", norm_placement="post_sublayer",
                       rope_base=500000.0),
    "pythia-160m": ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_len=2048,
                               pos="rope", rotary_dim=16, norm="layernorm", norm_eps=1e-5, mlp="gelu", mlp_bias=True,
                               qkv_bias=True, o_bias=True, parallel_residual=True),
    "phi3-mini": _llama(32064, 3072, 32, 32, 32, 8192, 4096).replace(norm_eps=1e-5),
    # Gemma 2B / Gemma 2 2B shapes (HF google/gemma-2b, google/gemma-2-2b); gemma2-2b's even layers slide (4096).
    "gemma-2b": _gemma(2048, 18, 8, 1, 16384),
    "gemma2-2b": _gemma(2304, 26, 8, 4, 9216, norm_placement="sandwich", attn_softcap=50.0, logit_softcap=30.0,
                        sliding_window=4096, window_layers=tuple(range(0, 26, 2))),
    # Gemma 3 1B shapes (HF google/gemma-3-1b-pt): every sixth layer global, the others slide over 512 positions
    # with RoPE base 1e4 (the global layers' 1e6).
    "gemma3-1b": _gemma(1152, 26, 4, 1, 6912, norm_placement="sandwich", qk_norm="head", rope_base=1_000_000.0,
                        rope_local_base=10_000.0, sliding_window=512,
                        window_layers=tuple(i for i in range(26) if (i + 1) % 6)).replace(vocab_size=262144,
                                                                                          max_len=32768),
    "seed-attnres-standard": _SEED_ATTNRES,
    "seed-attnres-full": _SEED_ATTNRES.replace(residual="full_attnres"),
    "seed-attnres-block": _SEED_ATTNRES.replace(residual="block_attnres", attnres_blocks=3),
    "seed-minibert": BertConfig(_SEED_MINIBERT, n_classes=2),
    "bert-base": BertConfig(_BERT_BASE, n_classes=2, type_vocab_size=2, embed_norm=True, pooler="tanh"),
    "seed-transformer": EncDecConfig(_SEED_ENCDEC, _SEED_ENCDEC.replace(vocab_size=8000)),
}


# The TrainConfig fields a preset trains with unless --set says otherwise, over TrainConfig's defaults
# (seed 000's, which the seed presets keep). GPT-2: weight decay on Linear weights and embeddings only,
# not LayerNorm gains or biases (nanoGPT's grouping; HF Trainer also leaves norms and biases out):
# results/defaults/nanogpt_decay.md.
TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {name: {"decay": "matrices"} for name in PRESETS if name.startswith("gpt2")}


def train_defaults(name: str) -> dict[str, Any]:
    """TrainConfig fields preset ``name`` is trained with by default (``jaxgpt train --preset``), e.g.
    ``TrainConfig(**train_defaults('gpt2-small'), steps=...)``; {} where TrainConfig's own apply."""
    get_preset(name)  # an unknown name is an error here too
    return dict(TRAIN_DEFAULTS.get(name, {}))


def get_preset(name: str) -> ModelConfig | BertConfig | EncDecConfig:
    """PRESETS[name], with an error listing the names when it is unknown."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


