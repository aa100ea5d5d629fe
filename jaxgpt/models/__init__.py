"""Model classes; ``build(config)`` picks the one a config describes."""
from __future__ import annotations

import flax.linen as nn

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


__all__ = ["DecoderLM", "DecoderOutput", "build", "init_cache"]
