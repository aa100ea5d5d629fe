"""Model classes; ``build(config)`` picks the one a config describes."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig
from jaxgpt.core.layout import stacked_paths  # framework-free: torch_ref shares it
from jaxgpt.models.decoder import DecoderLM, DecoderOutput, init_cache


def build(config: ModelConfig | BertConfig | EncDecConfig) -> nn.Module:
    """The linen module for ``config``: DecoderLM, BertClassifier or EncoderDecoder."""
    if isinstance(config, ModelConfig):
        return DecoderLM(config)
    if isinstance(config, BertConfig):
        from jaxgpt.models.bert import BertClassifier

        return BertClassifier(config)
    if isinstance(config, EncDecConfig):
        from jaxgpt.models.encdec import EncoderDecoder

        return EncoderDecoder(config)
    raise TypeError(f"build() takes a ModelConfig, BertConfig or EncDecConfig, got {type(config).__name__}")


def init_params(config: ModelConfig | BertConfig | EncDecConfig, rng) -> dict:
    """Freshly initialised params of ``build(config)`` (shapes do not depend on the dummy input).
    Under ``jax.eval_shape`` this gives the abstract tree without allocating anything."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    inputs = (tokens, tokens) if isinstance(config, EncDecConfig) else (tokens,)
    if isinstance(config, ModelConfig) and config.scan_layers and config.residual == "standard":
        # the scan's per-layer keys are split before the loop, so unrolling changes no value; rolled,
        # the jitted init compiles in about half the time (docs/performance.md)
        config = config.replace(scan_unroll=1)
    return build(config).init(rng, *inputs)["params"]


def abstract_params(config: ModelConfig | BertConfig | EncDecConfig) -> dict:
    """Parameter shapes (ShapeDtypeStructs) of ``build(config)`` for any config, without allocating."""
    import jax

    return jax.tree.map(lambda x: x, _abstract_params(config))  # fresh containers: callers may edit theirs


@functools.lru_cache(maxsize=32)  # a trace of init, asked for by every checkpoint read and converter
def _abstract_params(config) -> dict:
    import jax

    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def count_params(params) -> int:
    """Total number of parameters in a params tree (arrays or ShapeDtypeStructs)."""
    import jax
    import numpy as np

    return int(sum(np.prod(np.shape(a)) for a in jax.tree_util.tree_leaves(params)))


__all__ = ["DecoderLM", "DecoderOutput", "abstract_params", "build", "count_params", "init_cache", "init_params",
           "stacked_paths"]
