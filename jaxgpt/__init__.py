"""jaxgpt: functional Flax transformers with a mirrored PyTorch reference (torch_ref)."""
from jaxgpt.config import ModelConfig

__all__ = ["ModelConfig"]
__version__ = "0.1.0"
