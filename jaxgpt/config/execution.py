"""Execution: how a model is compiled and computed, apart from what it computes (ModelConfig).

Every field here leaves the model's numbers unchanged (the kernels compute the same math; scan and
remat change the program, not the values), so a checkpoint resumes under another Execution and a
converter ignores it. ``scan_layers`` also picks the params' layout (one stacked ``layers`` tree or
``layers_0 ... layers_{L-1}``); ``jaxgpt.core.layout.relayout`` converts between the two.
``MoEConfig.impl`` stays in the MoE config: its 'alltoall' with a ``capacity_factor`` drops tokens,
which is math, and the capacity rule is checked against it there.

Framework-free; 'auto' values are resolved per target platform by ``jaxgpt.nn.kernels.exec_policy``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from jaxgpt.config.base import _Config, _choice, _positive

# Rematerialisation of each layer: 'none' saves every activation, 'full' recomputes the whole layer in the
# backward pass, the others are jax.checkpoint_policies names.
REMATS = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
# Attention core (same math): 'xla' einsum softmax (returns weights for plots), 'jax'
# jax.nn.dot_product_attention (XLA implementation), 'cudnn' the same with cuDNN flash attention on GPU,
# 'blocked' a flash-style online-softmax loop over key/value blocks (memory linear in sequence length),
# 'ffi' the C++ CPU training kernel, 'auto' one of them per call, platform and shape (jaxgpt.nn.kernels).
ATTENTION_IMPLS = ("auto", "xla", "jax", "cudnn", "blocked", "ffi")
# LayerNorm / RMSNorm (same math): 'xla' jax.numpy, 'ffi' the C++ CPU kernel (jaxgpt.nn.kernels.norm_ffi),
# 'auto' the kernel in a CPU program where it is built, else 'xla'.
NORM_IMPLS = ("auto", "xla", "ffi")
# The exact GELU (same math): 'xla', 'ffi' the C++ CPU kernel (jaxgpt.nn.kernels.gelu_ffi), 'auto' the
# kernel in a float32 CPU program where it is built, else 'xla'. Other activations run XLA's.
ACT_IMPLS = ("auto", "xla", "ffi")
# The kernels without attention soft-capping (ModelConfig.attn_softcap): 'auto' avoids them; an explicit choice is refused.
SOFTCAP_REFUSED = ("jax", "cudnn", "ffi")
# float32 matmul precision (jaxgpt/nn/kernels/precision.py): 'auto' full float32 for float32 compute off the CPU
# (a GPU's default is TF32, which torch keeps off), the platform default for bf16/fp16 compute;
# 'default' the platform's default (TF32 on NVIDIA GPUs), 'high', 'highest' jax.lax.Precision's.
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")
# The platforms a program is lowered for; None: the platform of the devices it runs on (jaxgpt.nn.kernels.exec_policy).
PLATFORMS = (None, "cpu", "cuda", "rocm", "tpu")

_CHOICES = (("remat", REMATS), ("attention_impl", ATTENTION_IMPLS), ("norm_impl", NORM_IMPLS),
            ("act_impl", ACT_IMPLS), ("matmul_precision", MATMUL_PRECISIONS), ("platform", PLATFORMS))


@dataclass(frozen=True)
class Execution(_Config):
    """The kernels, layer loop, rematerialisation and matmul precision a model runs with.

    Pass it beside the ModelConfig: ``jaxgpt.models.build(config, execution)``, ``init_params``,
    ``generate``, the Engine, ``TrainConfig.execution`` for training. ``Execution()`` is the default.
    """

    # nn.scan over one Block (params (L, ...) under 'layers'); False: layers_0, layers_1, ... (one body each)
    scan_layers: bool = True
    # layers per iteration of the scanned loop (1 = rolled; >= n_layer = fully unrolled). 'auto': fully
    # unrolled in CPU and GPU programs without remat (the step of unrolled layers), else rolled.
    scan_unroll: int | str = "auto"
    remat: str = "none"  # one of REMATS: what each layer keeps for the backward pass
    attention_impl: str = "auto"  # one of ATTENTION_IMPLS
    attention_block: int = 128  # key/value block length of attention_impl='blocked' (docs/performance.md)
    norm_impl: str = "auto"  # one of NORM_IMPLS
    act_impl: str = "auto"  # one of ACT_IMPLS
    matmul_precision: str = "auto"  # one of MATMUL_PRECISIONS
    platform: str | None = None  # one of PLATFORMS: the target that resolves 'auto' (AOT lowering names it)

    def _validate(self) -> None:
        for name, allowed in _CHOICES:
            _choice(name, getattr(self, name), allowed)
        if self.scan_unroll != "auto":
            _positive("scan_unroll", self.scan_unroll)
        _positive("attention_block", self.attention_block)

    def check(self, config) -> None:
        """ValueError, in one line, where this execution cannot run ``config`` (a ModelConfig, or a
        BertConfig / EncDecConfig: each stack): called once where a model is built."""
        for stack in (getattr(config, "encoder", None), getattr(config, "decoder", None)):
            if stack is not None:
                self.check(stack)
        if not hasattr(config, "n_layer"):
            return
        if config.attn_softcap is not None and self.attention_impl in SOFTCAP_REFUSED:
            # jax.nn's attention and the C++ kernels have no score soft-capping: refused, never dropped
            raise ValueError(f"attention_impl={self.attention_impl!r} has no attention soft-capping (attn_softcap="
                             f"{config.attn_softcap}); use 'auto', 'xla' or 'blocked'")
        if self.attention_impl not in ("xla", "auto") and config.attention_dropout > 0:  # 'auto' picks 'xla' then
            # Only the einsum kernel can drop attention weights; no other kernel reproduces its draws.
            via = "" if config.attn_dropout is not None else f" (attn_dropout=None takes dropout={config.dropout})"
            raise ValueError(f"attention_impl={self.attention_impl!r} has no attention dropout, but attention "
                             f"dropout is {config.attention_dropout}{via}; set attn_dropout=0.0 or attention_impl='xla'")
        if config.residual != "standard" and (self.remat != "none" or self.scan_unroll not in (1, "auto")):
            raise ValueError(f"residual={config.residual!r} layers are not scanned or rematerialised; got "
                             f"remat={self.remat!r}, scan_unroll={self.scan_unroll} (use 'none' and 1 or 'auto')")
        if self.scan_layers and not uniform_layers(config):
            # nn.scan compiles one layer body: every layer must have the same parameters.
            moe = config.moe
            raise ValueError(f"moe.every={moe.every}, moe.dense_layers={list(moe.dense_layers)} mix dense and MoE "
                             "layers; that needs Execution(scan_layers=False)")

    @classmethod
    def for_model(cls, config, execution: "Execution | None" = None) -> "Execution":
        """``execution``, or where None the default for ``config``: ``Execution()``, with separate layers
        (scan_layers=False) for a stack whose layers differ in kind (mixed dense and MoE layers)."""
        if execution is not None:
            return execution
        stacks = [s for s in (getattr(config, "encoder", None), getattr(config, "decoder", None)) if s is not None]
        return cls(scan_layers=all(uniform_layers(s) for s in stacks or [config]))


def uniform_layers(config) -> bool:
    """Whether every layer of the ModelConfig ``config`` has the same parameters (one scanned body)."""
    return config.moe is None or len({config.sparse_layer(i) for i in range(config.n_layer)}) == 1


EXECUTION_FIELDS = tuple(f.name for f in fields(Execution) if f.name != "platform")


def moved(name: str, where: str = "model") -> str:
    """The one-line migration message for an execution key given where architecture keys go."""
    return (f"{name} moved to jaxgpt.config.Execution ({where}.{name} -> exec.{name}); pass "
            f"Execution({name}=...) beside the ModelConfig (TrainConfig.execution for training)")


def split_execution(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An old ModelConfig dict (saved before Execution existed) -> (the architecture's keys, the
    execution keys it held), e.g. a checkpoint's ``meta['config']``. Nested stacks (BERT's encoder,
    the encoder-decoder's two) give their execution keys too; the stacks of one model share one
    Execution, so where they differ the decoder's win."""
    arch, found = dict(d), {}
    for stack in ("encoder", "decoder"):
        if isinstance(arch.get(stack), dict):
            arch[stack], inner = split_execution(arch[stack])
            found.update(inner)
    for name in EXECUTION_FIELDS:
        if name in arch:
            found[name] = arch.pop(name)
    return arch, found


__all__ = ["ACT_IMPLS", "ATTENTION_IMPLS", "DEFAULT_EXECUTION", "EXECUTION_FIELDS", "Execution", "MATMUL_PRECISIONS", "NORM_IMPLS",
           "PLATFORMS", "REMATS", "SOFTCAP_REFUSED", "moved", "split_execution", "uniform_layers"]

DEFAULT_EXECUTION = Execution()  # the default of functions that take an Execution
