"""Model classes; ``build(config, execution)`` picks the one a config describes."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config import BertConfig, EncDecConfig, Execution, ModelConfig
from jaxgpt.core.layout import relayout, stacked_paths  # framework-free: torch_ref shares it
from jaxgpt.models.decoder import DecoderLM, DecoderOutput, init_cache


def build(config: ModelConfig | BertConfig | EncDecConfig, execution: Execution | None = None) -> nn.Module:
    """The linen module for ``config``: DecoderLM, BertClassifier or EncoderDecoder, run with
    ``execution`` (None: ``Execution.for_model(config)``; checked against the config here)."""
    execution = Execution.for_model(config, execution)
    execution.check(config)
    if isinstance(config, ModelConfig):
        return DecoderLM(config, execution)
    if isinstance(config, BertConfig):
        from jaxgpt.models.bert import BertClassifier

        return BertClassifier(config, execution)
    if isinstance(config, EncDecConfig):
        from jaxgpt.models.encdec import EncoderDecoder

        return EncoderDecoder(config, execution)
    raise TypeError(f"build() takes a ModelConfig, BertConfig or EncDecConfig, got {type(config).__name__}")


def init_params(config: ModelConfig | BertConfig | EncDecConfig, rng, execution: Execution | None = None) -> dict:
    """Freshly initialised params of ``build(config, execution)`` (shapes do not depend on the dummy
    input; the layout on ``execution.scan_layers``). Under ``jax.eval_shape`` this gives the abstract
    tree without allocating anything."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    inputs = (tokens, tokens) if isinstance(config, EncDecConfig) else (tokens,)
    execution = Execution.for_model(config, execution)
    if isinstance(config, ModelConfig) and execution.scan_layers and config.residual == "standard":
        # the scan's per-layer keys are split before the loop, so unrolling changes no value; rolled,
        # the jitted init compiles in about half the time (docs/performance.md)
        execution = execution.replace(scan_unroll=1)
    return build(config, execution).init(rng, *inputs)["params"]


def abstract_params(config: ModelConfig | BertConfig | EncDecConfig, execution: Execution | None = None) -> dict:
    """Parameter shapes (ShapeDtypeStructs) of ``build(config, execution)`` for any config, without allocating."""
    import jax

    # fresh containers: callers may edit theirs
    return jax.tree.map(lambda x: x, _abstract_params(config, Execution.for_model(config, execution)))


@functools.lru_cache(maxsize=32)  # a trace of init, asked for by every checkpoint read and converter
def _abstract_params(config, execution) -> dict:
    import jax

    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), execution))


def count_params(params) -> int:
    """Total number of parameters in a params tree (arrays or ShapeDtypeStructs)."""
    import jax
    import numpy as np

    return int(sum(np.prod(np.shape(a)) for a in jax.tree_util.tree_leaves(params)))


__all__ = ["DecoderLM", "DecoderOutput", "abstract_params", "build", "count_params", "init_cache", "init_params",
           "relayout", "stacked_paths"]
