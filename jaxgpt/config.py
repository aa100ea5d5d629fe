"""Frozen, validated model configuration shared by jaxgpt (Flax) and torch_ref (PyTorch).

This module imports no framework on purpose: torch_ref builds its modules from the very same
objects, so a config means the same architecture on both sides.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any

POS = ("none", "sinusoidal", "learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu")
PLACEMENTS = ("pre", "post")
ROPE_LAYOUTS = ("half", "interleaved")
RESIDUALS = ("standard", "full_attnres", "block_attnres")
ATTNRES_VARIANTS = ("seed", "paper")
POOLERS = ("cls", "tanh")
# Rematerialisation of each layer (engine knob, no numerical effect): 'none' saves every activation,
# 'full' recomputes the whole layer in the backward pass, the others are jax.checkpoint_policies names.
REMATS = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
# Precision policy: 'dtype' is the compute dtype of matmuls and activations, 'param_dtype' the stored
# (master) weights. Softmax, norm statistics, logits/loss and optimizer state stay float32 whatever they are.
DTYPES = ("float32", "bfloat16", "float16")
# Attention core (engine knob, same math): 'xla' einsum softmax (returns weights for plots), 'jax'
# jax.nn.dot_product_attention (XLA implementation), 'cudnn' the same with cuDNN flash attention on GPU,
# 'blocked' a flash-style online-softmax loop over key/value blocks (memory linear in sequence length).
ATTENTION_IMPLS = ("xla", "jax", "cudnn", "blocked")

# torch.nn.RMSNorm(eps=None) uses the float32 machine epsilon; seed 002 relies on that default.
FLOAT32_EPS = 1.1920928955078125e-07


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError for sampling settings that cannot sample (jaxgpt and torch_ref generation)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not top_k >= 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _type_name(t: type) -> str:
    if t is type(None):
        return "None"
    return f"{'an' if t.__name__[0] in 'aeiou' else 'a'} {t.__name__}"


class _Config:
    """Type checking and replace / to_dict / from_dict shared by the frozen config dataclasses.

    ``__post_init__`` checks every field against its annotation before the subclass's
    ``_validate`` checks ranges, so a new field is type-checked without extra code. Ints are
    accepted for float fields (and stored as floats); bool is not accepted as an int.
    """

    @classmethod
    @functools.cache
    def field_types(cls) -> dict[str, tuple[type, ...]]:
        """Field name -> the types its annotation allows (``int | None`` -> (int, NoneType))."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            out[f.name] = typing.get_args(t) if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union \
                else (t,)
        return out

    def __post_init__(self) -> None:
        for name, allowed in self.field_types().items():
            value = getattr(self, name)
            if value is None and type(None) in allowed:
                continue
            if isinstance(value, bool) or type(value).__name__ == "bool_":  # bool subclasses int: not a number here
                ok, value = bool in allowed, bool(value)
            elif isinstance(value, numbers.Integral) and (int in allowed or float in allowed):
                ok, value = True, (int if int in allowed else float)(value)
            elif isinstance(value, numbers.Real) and float in allowed:
                ok, value = True, float(value)
                if not math.isfinite(value):
                    raise ValueError(f"{name} must be a finite number, got {value!r}")
            else:
                ok = any(t not in (int, float, bool) and isinstance(value, t) for t in allowed)
            if not ok:
                expected = " or ".join(_type_name(t) for t in allowed)
                raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, value)  # frozen: normalise 1 -> 1.0, np.int64 -> int
        self._validate()

    def _validate(self) -> None:
        """Ranges and cross-field rules (the types are already checked)."""

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Inverse of ``to_dict``; unknown keys are an error (nested configs override this)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class ModelConfig(_Config):
    """One transformer stack. Variants are knobs, not subclasses.

    Sizes: ``d_model`` is split into ``n_head`` heads of ``head_dim``; keys and values use
    ``n_kv_head`` heads (``None`` = ``n_head``: MHA; 1: MQA; otherwise GQA).
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_ff: int | None = None  # None: 4 * d_model (swiglu: 2/3 of that, rounded up to a multiple of 8)
    max_len: int = 256  # context window; sizes learned/sinusoidal tables and KV caches
    pos: str = "sinusoidal"
    rope_base: float = 10000.0
    rope_layout: str = "half"  # 'half' = HF LLaMA rotate_half, 'interleaved' = adjacent pairs (seed 000)
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    mlp: str = "swiglu"
    mlp_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    norm_placement: str = "pre"
    final_norm: bool = True
    dropout: float = 0.0  # embedding and residual-branch dropout
    attn_dropout: float | None = 0.0  # None: the same as dropout (nanoGPT's and GPT-2's single dropout)
    tie_embeddings: bool = False
    lm_head_bias: bool = False  # bias on the untied output projection (seed 004's decoder-only models)
    init_std: float = 0.02
    scale_out_init: bool = False  # GPT-2: o_proj/down_proj/fc_out std = init_std / sqrt(2 n_layer)
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model) (seed 004 encoder-decoder)
    # Attention Residuals (seed 002 / arXiv 2603.15031): depth-wise softmax mixing of earlier outputs.
    residual: str = "standard"
    attnres_variant: str = "seed"  # 'seed': the seed's code exactly; 'paper': the published formulation
    attnres_blocks: int = 4  # block_attnres: number of blocks N (seed: layers per block = max(1, n_layer // N))
    attnres_eps: float | None = None  # key RMSNorm eps (None: norm_eps)
    attnres_key_gain: bool = True  # learnable gain in the key RMSNorm (the paper leaves this open)
    # Engine knobs: how the layer stack is compiled; they change neither the math nor torch_ref.
    scan_layers: bool = True  # nn.scan over one Block (params (L, ...) under 'layers'); False: layers_0, layers_1, ...
    scan_unroll: int = 1  # layers per iteration of the scanned loop (1 = rolled; >= n_layer = fully unrolled)
    remat: str = "none"  # one of REMATS: what each layer keeps for the backward pass
    attention_impl: str = "xla"  # one of ATTENTION_IMPLS
    attention_block: int = 512  # key/value block length of attention_impl='blocked'
    dtype: str = "float32"  # compute dtype (DTYPES); bfloat16 with param_dtype float32 = mixed precision
    param_dtype: str = "float32"  # dtype the weights are stored (and optimised) in

    def _validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "max_len"):
            _positive(name, getattr(self, name))
        if self.n_kv_head is not None:
            _positive("n_kv_head", self.n_kv_head)
        if self.d_ff is not None:
            _positive("d_ff", self.d_ff)
        _choice("pos", self.pos, POS)
        _choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        _choice("norm", self.norm, NORMS)
        _choice("mlp", self.mlp, MLPS)
        _choice("norm_placement", self.norm_placement, PLACEMENTS)
        _choice("residual", self.residual, RESIDUALS)
        _choice("attnres_variant", self.attnres_variant, ATTNRES_VARIANTS)
        _positive("attnres_blocks", self.attnres_blocks)
        _positive("scan_unroll", self.scan_unroll)
        _choice("remat", self.remat, REMATS)
        _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _positive("attention_block", self.attention_block)
        _choice("dtype", self.dtype, DTYPES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        if self.residual != "standard" and (self.remat != "none" or self.scan_unroll != 1):
            raise ValueError(f"residual={self.residual!r} layers are not scanned or rematerialised; got "
                             f"remat={self.remat!r}, scan_unroll={self.scan_unroll} (use 'none' and 1)")
        if self.residual != "standard" and self.norm_placement != "pre":
            raise ValueError(f"residual={self.residual!r} mixes pre-norm sublayer outputs; it needs norm_placement='pre'")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.pos == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        _probability("dropout", self.dropout)
        if self.attn_dropout is not None:
            _probability("attn_dropout", self.attn_dropout)
        if self.lm_head_bias and self.tie_embeddings:
            raise ValueError("lm_head_bias=True needs an untied lm_head (tie_embeddings=False)")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def attention_dropout(self) -> float:
        """The attention-weight dropout rate: ``attn_dropout``, or ``dropout`` when that is None."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":  # keep the parameter count of a 4x two-matrix MLP
            return -(-(8 * self.d_model // 3) // 8) * 8
        return 4 * self.d_model

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
        if self.encoder.pos == "rope":
            raise ValueError("BERT uses absolute positions: encoder.pos must not be 'rope'")


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


    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EncDecConfig":
        return cls(**{**d, "encoder": ModelConfig.from_dict(d["encoder"]),
                      "decoder": ModelConfig.from_dict(d["decoder"])})


SCHEDULES = ("cosine", "constant")
DECAY = ("all", "linear", "matrices")
TOKENIZERS = ("char", "bpe")
ON_NONFINITE = ("stop", "skip")


@dataclass(frozen=True)
class TrainConfig(_Config):
    """Optimisation and data settings, shared by jaxgpt.train and torch_ref.train.

    Defaults are seed 000's: AdamW(lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on every
    parameter), cosine annealing to 0.1 * lr, gradient clipping at 1.0, batches of 32 x 64.
    """

    steps: int = 500
    batch_size: int = 32  # sequences per optimizer step (split into grad_accum micro-batches)
    seq_len: int = 64  # LM window; pair and classification data: padded sequence length
    grad_accum: int = 1
    lr: float = 3e-4
    schedule: str = "cosine"  # 'cosine': linear warmup, then cosine to lr * min_lr_ratio; 'constant'
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # 'all': every parameter (the seeds, torch AdamW); 'linear': Linear kernels only; 'matrices': Linear
    # kernels and embeddings, not norms or biases (nanoGPT's "every >= 2-D parameter")
    decay: str = "all"
    grad_clip: float | None = 1.0  # global-norm clip; None = off
    seed: int = 0  # init, batch order and dropout all derive from it
    tokenizer: str = "char"  # text files: 'char' (sorted characters) or 'bpe' (trained locally)
    bpe_vocab: int = 1024
    val_fraction: float = 0.1  # 0: train on everything (no validation split, no evaluation)
    # Epoch-based runs: epochs > 0 makes the run epochs passes over the training data; steps and
    # steps_per_epoch are then derived from the data (jaxgpt.train.tasks.with_epochs; jaxgpt train does it).
    epochs: int = 0
    steps_per_epoch: int = 0  # set by with_epochs; 0 = unknown
    lr_per_epoch: bool = False  # the schedule advances once per epoch (CosineAnnealingLR(T_max=epochs), seed 002)
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 100  # 0 = only at the end
    keep: int = 3  # checkpoints kept on disk (plus the newest until it has been read back intact)
    # A NaN/inf loss or gradient norm: 'stop' (error naming the step, nothing saved after it) or 'skip' (the
    # jitted step keeps the old params and optimizer state; the batch is consumed, metrics count it).
    on_nonfinite: str = "stop"
    # Engine knob (jaxgpt.sharding): device mesh 'data=N,fsdp=M,tensor=K' ('' = one device). It changes
    # placement, not the math; a run may resume on another mesh. batch_size / grad_accum must divide by data*fsdp.
    mesh: str = ""

    def _validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "log_every", "keep"):
            _positive(name, getattr(self, name))
        for name in ("warmup_steps", "eval_every", "ckpt_every", "seed", "epochs", "steps_per_epoch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("decay", self.decay, DECAY)
        _choice("tokenizer", self.tokenizer, TOKENIZERS)
        _choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        if self.bpe_vocab < 257:
            raise ValueError(f"bpe_vocab must be >= 257 (256 byte tokens + merges), got {self.bpe_vocab!r}")
        if self.warmup_steps >= self.steps and self.schedule == "cosine" and self.warmup_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be < steps={self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        _probability("beta1", self.beta1)
        _probability("beta2", self.beta2)
        if self.weight_decay < 0 or self.eps <= 0:
            raise ValueError(f"need weight_decay >= 0 and eps > 0, got {self.weight_decay!r}, {self.eps!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if self.lr_per_epoch and not self.epochs:
            raise ValueError("lr_per_epoch=True steps the schedule once per epoch: it needs epochs > 0")
        if self.steps_per_epoch and self.epochs and self.steps != self.epochs * self.steps_per_epoch:
            raise ValueError(f"steps={self.steps} is not epochs * steps_per_epoch = {self.epochs} * "
                             f"{self.steps_per_epoch}; derive them with jaxgpt.train.tasks.with_epochs")
        if self.mesh:
            from jaxgpt.mesh_spec import parse_mesh  # framework-free

            sizes = parse_mesh(self.mesh)
            if self.micro_batch % (sizes["data"] * sizes["fsdp"]):
                raise ValueError(f"mesh={self.mesh!r} splits each micro-batch over data*fsdp="
                                 f"{sizes['data'] * sizes['fsdp']} devices, but batch_size/grad_accum="
                                 f"{self.micro_batch} is not a multiple of it")

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def schedule_units(self) -> tuple[int, int]:
        """(updates per schedule step, schedule steps in the run): (1, steps), or with lr_per_epoch
        (steps_per_epoch, epochs)."""
        if self.lr_per_epoch:
            if not self.steps_per_epoch:
                raise ValueError("lr_per_epoch needs steps_per_epoch: derive it with jaxgpt.train.tasks.with_epochs")
            return self.steps_per_epoch, self.epochs
        return 1, self.steps

    def lr_at(self, step: int) -> float:
        """Learning rate of update ``step`` (0-based): linear warmup over ``warmup_steps`` (reaching
        lr at step warmup_steps - 1), then cosine from lr to lr * min_lr_ratio at ``steps``. With
        lr_per_epoch the unit is the epoch: update ``step`` uses epoch step // steps_per_epoch, and
        warmup_steps counts epochs. jaxgpt.train.optim.schedule is the same formula in jnp."""
        if self.schedule == "constant":
            return self.lr
        per, total = self.schedule_units
        step //= per
        w, floor = self.warmup_steps, self.lr * self.min_lr_ratio
        if step < w:
            return self.lr * (step + 1) / w
        progress = min(max((step - w) / max(total - w, 1), 0.0), 1.0)
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _gpt2(d_model: int, n_layer: int, n_head: int, **kw: Any) -> ModelConfig:
    base = dict(vocab_size=50257, max_len=1024, d_model=d_model, n_layer=n_layer, n_head=n_head, pos="learned",
                norm="layernorm", norm_eps=1e-5, mlp="gelu_tanh", mlp_bias=True, qkv_bias=True, o_bias=True,
                tie_embeddings=True, dropout=0.1, attn_dropout=None, scale_out_init=True)
    return ModelConfig(**{**base, **kw})


def _llama(vocab_size: int, d_model: int, n_layer: int, n_head: int, n_kv_head: int, d_ff: int, max_len: int,
           **kw: Any) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                       d_ff=d_ff, max_len=max_len, pos="rope", rope_layout="half", norm="rmsnorm", norm_eps=1e-6,
                       mlp="swiglu", **kw)


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
    "seed-attnres-standard": _SEED_ATTNRES,
    "seed-attnres-full": _SEED_ATTNRES.replace(residual="full_attnres"),
    "seed-attnres-block": _SEED_ATTNRES.replace(residual="block_attnres", attnres_blocks=3),
    "seed-minibert": BertConfig(_SEED_MINIBERT, n_classes=2),
    "bert-base": BertConfig(_BERT_BASE, n_classes=2, type_vocab_size=2, embed_norm=True, pooler="tanh"),
    "seed-transformer": EncDecConfig(_SEED_ENCDEC, _SEED_ENCDEC.replace(vocab_size=8000)),
}


def get_preset(name: str) -> ModelConfig | BertConfig | EncDecConfig:
    """PRESETS[name], with an error listing the names when it is unknown."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def config_from_dict(d: dict[str, Any]) -> ModelConfig | BertConfig | EncDecConfig:
    """Inverse of ``config.to_dict()`` for any of the three config types."""
    if "decoder" in d:
        return EncDecConfig.from_dict(d)
    if "encoder" in d:
        return BertConfig.from_dict(d)
    return ModelConfig.from_dict(d)
