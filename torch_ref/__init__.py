"""torch_ref: the PyTorch mirror of jaxgpt (same files, class names and parameter names)."""
from jaxgpt.config import PRESETS, BertConfig, EncDecConfig, ModelConfig, get_preset
from torch_ref.models import build

__all__ = ["PRESETS", "BertConfig", "EncDecConfig", "ModelConfig", "build", "get_preset"]
