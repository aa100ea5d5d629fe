"""Model classes mirroring jaxgpt.models; ``build(config)`` picks one."""
from __future__ import annotations

from torch import nn

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig
from torch_ref.models.bert import BertClassifier
from torch_ref.models.decoder import DecoderLM, DecoderOutput, init_cache
from torch_ref.models.encdec import EncoderDecoder

MODELS = (DecoderLM, BertClassifier, EncoderDecoder)  # whole models, as opposed to their parts


def build(config: ModelConfig | BertConfig | EncDecConfig) -> nn.Module:
    """The torch module for ``config``: DecoderLM, BertClassifier or EncoderDecoder."""
    if isinstance(config, ModelConfig):
        return DecoderLM(config)
    if isinstance(config, BertConfig):
        return BertClassifier(config)
    if isinstance(config, EncDecConfig):
        return EncoderDecoder(config)
    raise TypeError(f"build() takes a ModelConfig, BertConfig or EncDecConfig, got {type(config).__name__}")


__all__ = ["MODELS", "BertClassifier", "DecoderLM", "DecoderOutput", "EncoderDecoder", "build", "init_cache"]
