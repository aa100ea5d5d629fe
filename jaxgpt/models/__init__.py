"""Model classes; ``build(config)`` picks the one a config describes."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig
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


def stacked_paths(config: ModelConfig | BertConfig | EncDecConfig) -> tuple[str, ...]:
    """Flax paths of the ``nn.scan`` layer stacks (the converter's ``stacked=``)."""
    if isinstance(config, EncDecConfig):
        from jaxgpt.models.encdec import STACKED

        return STACKED
    if isinstance(config, ModelConfig) and config.residual != "standard":
        return ()  # AttnRes layers are separate modules (layers_0, layers_1, ...)
    return ("layers",)


def init_params(config: ModelConfig | BertConfig | EncDecConfig, rng) -> dict:
    """Freshly initialised params of ``build(config)`` (shapes do not depend on the dummy input).
    Under ``jax.eval_shape`` this gives the abstract tree without allocating anything."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    inputs = (tokens, tokens) if isinstance(config, EncDecConfig) else (tokens,)
    return build(config).init(rng, *inputs)["params"]


__all__ = ["DecoderLM", "DecoderOutput", "build", "init_cache", "init_params", "stacked_paths"]
