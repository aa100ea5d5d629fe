"""Model configs: one decoder/encoder stack (ModelConfig), BERT and the encoder-decoder.

Framework-free on purpose: torch_ref builds its modules from the very same objects, so a config
means the same architecture on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxgpt.config.base import _Config, _choice, _positive, _probability
from jaxgpt.config.execution import (ACT_IMPLS, ATTENTION_IMPLS, EXECUTION_FIELDS, MATMUL_PRECISIONS,  # noqa: F401
                                     NORM_IMPLS, REMATS, SOFTCAP_REFUSED, moved)
from jaxgpt.config.moe import MoEConfig
from jaxgpt.config.rope import RopeScaling

POS = ("none", "sinusoidal", "learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu_tanh")  # geglu_tanh: SwiGLU with tanh-GELU (Gemma)
GATED_MLPS = ("swiglu", "geglu_tanh")  # gate_proj / up_proj / down_proj
# 'post_sublayer': x + norm(f(x)), the norm on the sublayer's output inside the residual (OLMo 2);
# 'sandwich': x + post_norm(f(norm(x))) (Gemma 2)
PLACEMENTS = ("pre", "post", "post_sublayer", "sandwich")
# An RMSNorm on the projected queries and keys before RoPE: 'head' over each head's D (Qwen3),
# 'full' over the whole projection, H*D and H_kv*D (OLMo 2); None: none.
QK_NORMS = (None, "head", "full")
ROPE_LAYOUTS = ("half", "interleaved")
RESIDUALS = ("standard", "full_attnres", "block_attnres")
ATTNRES_VARIANTS = ("seed", "paper")
POOLERS = ("cls", "tanh")
# Precision policy: 'dtype' is the compute dtype of matmuls and activations, 'param_dtype' the stored
# (master) weights. Softmax, norm statistics, logits/loss and optimizer state stay float32 whatever they are.
DTYPES = ("float32", "bfloat16", "float16")
# torch.nn.RMSNorm(eps=None) uses the float32 machine epsilon; seed 002 relies on that default.
FLOAT32_EPS = 1.1920928955078125e-07

# ModelConfig's fields that take one of a fixed set of values, with that set
_CHOICES = (("pos", POS), ("rope_layout", ROPE_LAYOUTS), ("norm", NORMS), ("mlp", MLPS), ("norm_placement", PLACEMENTS),
            ("residual", RESIDUALS), ("attnres_variant", ATTNRES_VARIANTS), ("dtype", DTYPES), ("param_dtype", DTYPES),
            ("qk_norm", QK_NORMS))



def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError for sampling settings that cannot sample (jaxgpt and torch_ref generation)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not top_k >= 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@dataclass(frozen=True)
class ModelConfig(_Config):
    """One transformer stack. Variants are knobs, not subclasses.

    Sizes: ``d_model`` is split into ``n_head`` heads of ``head_dim``; keys and values use
    ``n_kv_head`` heads (``None`` = ``n_head``: MHA; 1: MQA; otherwise GQA). The architecture only:
    kernels, layer scan, remat and matmul precision are ``jaxgpt.config.Execution``'s.
    """

    def __new__(cls, *args, **kwargs):
        # a config written before Execution existed: one line naming where the key went
        old = [k for k in kwargs if k in EXECUTION_FIELDS]
        if old:
            raise ValueError(moved(old[0]))
        return super().__new__(cls)

    vocab_size: int = 256  # rows of the embedding and logit tables
    # The tokenizer's vocabulary when vocab_size is a padded table (nanoGPT's 50304 for GPT-2's 50257, a
    # faster matmul on GPUs): ids >= valid_vocab are never inputs, and their logits are the float32 minimum
    # (no probability, no gradient, never sampled). None: every id is a token.
    valid_vocab: int | None = None
    # The padding token (HF LLaMA/Mistral/Qwen2/Mixtral/BERT's pad_token_id): its embedding row gets no
    # gradient, as torch's nn.Embedding(padding_idx=...) does; the forward pass is unchanged. None: no such row.
    pad_token_id: int | None = None
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_head: int | None = None  # width of each head; None: d_model // n_head (Gemma and Qwen3 set it apart)
    d_ff: int | None = None  # None: 4 * d_model (gated MLPs: 2/3 of that, rounded up to a multiple of 8)
    max_len: int = 256  # context window; sizes learned/sinusoidal tables and KV caches
    # Sliding-window attention (Mistral, Qwen2): the query at position i sees the keys j with
    # i - sliding_window < j <= i (transformers' rule). None: every layer attends to all earlier keys.
    sliding_window: int | None = None
    # The layers (0-based) that slide; the others attend globally. None: every layer, when sliding_window is set.
    window_layers: tuple | list | None = None
    pos: str = "sinusoidal"
    rope_base: float = 10000.0
    # The RoPE base of sliding layers (layer_window(i) not None), which take no rope_scaling (Gemma 3's
    # local layers). None: every layer uses rope_base and rope_scaling.
    rope_local_base: float | None = None
    rope_layout: str = "half"  # 'half' = HF LLaMA rotate_half, 'interleaved' = adjacent pairs (seed 000)
    rope_scaling: RopeScaling | None = None  # RoPE scaling variant (jaxgpt/config/rope.py); None: plain RoPE
    rotary_dim: int | None = None  # RoPE rotates only the first rotary_dim dims of each head (GPT-NeoX); None: all
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    norm_unit_offset: bool = False  # the norms scale by (1 + scale), scale initialised to 0 (Gemma's RMSNorm)
    mlp: str = "swiglu"
    mlp_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    norm_placement: str = "pre"
    parallel_residual: bool = False  # x + attn(attn_norm(x)) + mlp(mlp_norm(x)): both read the layer's input (GPT-NeoX)
    qk_norm: str | None = None  # one of QK_NORMS; eps norm_eps, params attn.q_norm / attn.k_norm
    final_norm: bool = True
    dropout: float = 0.0  # embedding and residual-branch dropout
    attn_dropout: float | None = 0.0  # None: the same as dropout (nanoGPT's and GPT-2's single dropout)
    tie_embeddings: bool = False
    lm_head_bias: bool = False  # bias on the untied output projection (seed 004's decoder-only models)
    init_std: float = 0.02
    scale_out_init: bool = False  # GPT-2: o_proj/down_proj/fc_out std = init_std / sqrt(2 n_layer)
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model) (seed 004 encoder-decoder, Gemma)
    attn_scale: float | None = None  # attention-score multiplier; None: head_dim ** -0.5 (Gemma 2 sets it apart)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2); None: off
    logit_softcap: float | None = None  # final logits -> cap * tanh(logits / cap) (Gemma 2); None: off
    # Attention Residuals (seed 002 / arXiv 2603.15031): depth-wise softmax mixing of earlier outputs.
    residual: str = "standard"
    attnres_variant: str = "seed"  # 'seed': the seed's code exactly; 'paper': the published formulation
    attnres_blocks: int = 4  # block_attnres: number of blocks N (seed: layers per block = max(1, n_layer // N))
    attnres_eps: float | None = None  # key RMSNorm eps (None: norm_eps)
    attnres_key_gain: bool = True  # learnable gain in the key RMSNorm (the paper leaves this open)
    dtype: str = "float32"  # compute dtype (DTYPES); bfloat16 with param_dtype float32 = mixed precision
    param_dtype: str = "float32"  # dtype the weights are stored (and optimised) in
    # Mixture of Experts (jaxgpt/config/moe.py): None = every layer's FFN is the dense ``mlp``.
    moe: MoEConfig | None = None

    def _validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_len"):
            _positive(name, getattr(self, name))
        if self.n_kv_head is not None:
            _positive("n_kv_head", self.n_kv_head)
        if self.valid_vocab is not None and not 0 < self.valid_vocab < self.vocab_size:
            raise ValueError(f"valid_vocab={self.valid_vocab} must be in (0, vocab_size={self.vocab_size}) (the "
                             "tokenizer's vocabulary inside a padded table; None: no padding)")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.token_vocab:
            raise ValueError(f"pad_token_id={self.pad_token_id} is not a token id in [0, {self.token_vocab})")
        if self.d_ff is not None:
            _positive("d_ff", self.d_ff)
        self._validate_window()
        for name, allowed in _CHOICES:
            _choice(name, getattr(self, name), allowed)
        _positive("attnres_blocks", self.attnres_blocks)
        if self.residual != "standard" and self.norm_placement != "pre":
            raise ValueError(f"residual={self.residual!r} mixes pre-norm sublayer outputs; it needs norm_placement='pre'")
        if self.d_head is not None:
            _positive("d_head", self.d_head)
        elif self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.pos == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        self._validate_variants()
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        if self.rope_local_base is not None and not self.rope_local_base > 1:
            raise ValueError(f"rope_local_base must be None or > 1, got {self.rope_local_base}")
        if self.rope_scaling is not None:
            if self.pos != "rope":
                raise ValueError(f"rope_scaling={self.rope_scaling.rope_type!r} needs pos='rope', got pos={self.pos!r}")
            self.rope_scaling.check_model(self.head_dim, self.max_len)
        _probability("dropout", self.dropout)
        if self.attn_dropout is not None:
            _probability("attn_dropout", self.attn_dropout)
        if self.lm_head_bias and self.tie_embeddings:
            raise ValueError("lm_head_bias=True needs an untied lm_head (tie_embeddings=False)")
        if self.moe is not None:
            self._validate_moe()
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")

    def _validate_variants(self) -> None:
        if self.rotary_dim is not None:
            _positive("rotary_dim", self.rotary_dim)
            if self.pos != "rope" or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim={self.rotary_dim} needs pos='rope' (got {self.pos!r}) and an even "
                                 f"width <= head_dim={self.head_dim} (None: rotate the whole head)")
        if self.parallel_residual and (self.norm_placement != "pre" or self.residual != "standard"):
            raise ValueError(f"parallel_residual=True needs norm_placement='pre' and residual='standard', got "
                             f"{self.norm_placement!r} and {self.residual!r}")

    def _validate_window(self) -> None:
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
            if self.residual != "standard":
                raise ValueError(f"sliding_window={self.sliding_window} needs residual='standard' (the attention-"
                                 f"residual layers have no window), got residual={self.residual!r}")
        if self.window_layers is None:
            return
        object.__setattr__(self, "window_layers", tuple(self.window_layers))
        if self.sliding_window is None:
            raise ValueError(f"window_layers={list(self.window_layers)} needs a sliding_window (got None)")
        bad = [i for i in self.window_layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layer]
        if bad or len(set(self.window_layers)) != len(self.window_layers):
            raise ValueError(f"window_layers={list(self.window_layers)} must hold distinct layer indices in "
                             f"[0, n_layer={self.n_layer})")
        object.__setattr__(self, "window_layers", tuple(sorted(self.window_layers)))

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (0-based): ``sliding_window`` where it slides, else None."""
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    def _validate_moe(self) -> None:
        moe = self.moe
        if self.residual != "standard":
            raise ValueError(f"moe needs residual='standard', got residual={self.residual!r}")
        out = [i for i in moe.dense_layers if i >= self.n_layer]
        if out:
            raise ValueError(f"moe.dense_layers={list(moe.dense_layers)} names layers past n_layer={self.n_layer}")

    def sparse_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a MoE feed-forward network."""
        return self.moe is not None and self.moe.sparse(layer)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        old = [k for k in d if k in EXECUTION_FIELDS]
        if old:  # jaxgpt.config.split_execution(d) separates them (checkpoints and files do it on load)
            raise ValueError(moved(old[0]))
        for key, cls_ in (("moe", MoEConfig), ("rope_scaling", RopeScaling)):
            if isinstance(d.get(key), dict):
                d = {**d, key: cls_.from_dict(d[key])}
        return super().from_dict(d)

    # Derived sizes -------------------------------------------------------------------------
    @property
    def attention_dropout(self) -> float:
        """The attention-weight dropout rate: ``attn_dropout``, or ``dropout`` when that is None."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def token_vocab(self) -> int:
        """How many ids are tokens: ``valid_vocab``, or ``vocab_size`` when the table is not padded."""
        return self.vocab_size if self.valid_vocab is None else self.valid_vocab

    @property
    def head_dim(self) -> int:
        """Width of each attention head: ``d_head``, or ``d_model // n_head``."""
        return self.d_model // self.n_head if self.d_head is None else self.d_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp in GATED_MLPS:  # keep the parameter count of a 4x two-matrix MLP
            return -(-(8 * self.d_model // 3) // 8) * 8
        return 4 * self.d_model

    @property
    def expert_dim(self) -> int:
        """Width of each MoE expert: ``moe.d_ff``, or ``ffn_dim``."""
        return self.moe.d_ff if self.moe is not None and self.moe.d_ff is not None else self.ffn_dim

    @property
    def out_init_std(self) -> float:
        """Init std of the projections that write into the residual stream."""
        return self.init_std / (2 * self.n_layer) ** 0.5 if self.scale_out_init else self.init_std


@dataclass(frozen=True)
class BertConfig(_Config):
    """An encoder with a sequence classifier: seed 004's MiniBERT or the standard BERT layout.

    MiniBERT: learned positions, Pre-LN layers, final LayerNorm, classifier on the [CLS] vector.
    BERT: + token-type embeddings and an embedding LayerNorm, Post-LN layers (no final norm),
    tanh pooler (dense + tanh on [CLS]) before the classifier.
    """

    encoder: ModelConfig
    n_classes: int = 2
    type_vocab_size: int = 0  # 0: no token-type embeddings
    embed_norm: bool = False  # LayerNorm on the summed embeddings
    pooler: str = "cls"  # 'cls': classifier(h[:, 0]); 'tanh': classifier(tanh(dense(h[:, 0])))

    def _validate(self) -> None:
        _positive("n_classes", self.n_classes)
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        _choice("pooler", self.pooler, POOLERS)
        if self.encoder.moe is not None:
            raise ValueError("BERT has no Mixture-of-Experts layers: encoder.moe must be None")
        if self.encoder.pos == "rope":
            raise ValueError("BERT uses absolute positions: encoder.pos must not be 'rope'")
        if self.encoder.valid_vocab is not None:
            raise ValueError("BERT has no language-model head to mask: encoder.valid_vocab must be None")
        if self.encoder.sliding_window is not None:
            raise ValueError(f"BERT attends both ways: encoder.sliding_window={self.encoder.sliding_window} needs "
                             "causal attention (set None)")


    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BertConfig":
        return cls(**{**d, "encoder": ModelConfig.from_dict(d["encoder"])})


@dataclass(frozen=True)
class EncDecConfig(_Config):
    """Encoder-decoder Transformer (seed 004): the decoder's blocks add cross-attention over the
    encoder output; the output projection maps to decoder.vocab_size."""

    encoder: ModelConfig
    decoder: ModelConfig
    out_bias: bool = True  # seed 004's output Linear has a bias

    def _validate(self) -> None:
        if self.encoder.d_model != self.decoder.d_model:
            raise ValueError(f"encoder.d_model={self.encoder.d_model} != decoder.d_model={self.decoder.d_model}")
        if self.encoder.moe is not None or self.decoder.moe is not None:
            raise ValueError("the encoder-decoder has no Mixture-of-Experts layers: encoder.moe and decoder.moe "
                             "must be None")
        if self.encoder.valid_vocab is not None or self.decoder.valid_vocab is not None:
            raise ValueError("the encoder-decoder has no padded vocabulary: encoder.valid_vocab and "
                             "decoder.valid_vocab must be None")
        if self.encoder.sliding_window is not None:
            raise ValueError(f"the encoder attends both ways: encoder.sliding_window={self.encoder.sliding_window} "
                             "needs causal attention (set None; the decoder's may slide)")


    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EncDecConfig":
        return cls(**{**d, "encoder": ModelConfig.from_dict(d["encoder"]),
                      "decoder": ModelConfig.from_dict(d["decoder"])})


def config_from_dict(d: dict[str, Any]) -> ModelConfig | BertConfig | EncDecConfig:
    """Inverse of ``config.to_dict()`` for any of the three config types."""
    if "decoder" in d:
        return EncDecConfig.from_dict(d)
    if "encoder" in d:
        return BertConfig.from_dict(d)
    return ModelConfig.from_dict(d)
