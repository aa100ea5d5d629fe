"""torch_ref: the PyTorch mirror of jaxgpt (same files, class names and parameter names)."""
from jaxgpt.config import ModelConfig

__all__ = ["ModelConfig"]
