"""Batch conventions shared by the models, the losses, the data pipeline and torch_ref."""
from __future__ import annotations

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig

# Opt-in target value for "no loss here" (the torch and Hugging Face convention). Seed 002
# keeps <pad> in its targets and passes ignore_index=pad_id to the loss instead; encode_pairs
# does the same unless asked for IGNORE_INDEX.
IGNORE_INDEX = -100

# The package version (pyproject.toml's), here so that modules below the package root can read it.
__version__ = "0.1.0"

# The batch dict each model kind trains on: inputs in call order, then the targets.
BATCH_KEYS = {
    ModelConfig: ("x", "y"),  # x (B, T) ids, y (B, T) next ids (IGNORE_INDEX = no loss)
    BertConfig: ("input_ids", "attention_mask", "labels"),  # (B, T), (B, T) bool, (B,)
    EncDecConfig: ("src", "tgt", "src_mask", "labels"),  # (B, S), (B, T), (B, S) bool, (B, T)
}

# Optional keys of a language-model batch, passed to the model by name (TrainConfig.documents):
# segment_ids (B, T) int32 document ids, positions (B, T) int32 positions inside each document.
DOCUMENT_KEYS = ("segment_ids", "positions")


def batch_keys(config) -> tuple[str, ...]:
    """Keys of the batch dict ``config``'s model trains on: its inputs in call order, then targets."""
    return BATCH_KEYS[type(config)]

