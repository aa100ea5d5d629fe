"""jaxgpt: functional Flax transformers with a mirrored PyTorch reference (torch_ref).

Importing ``jaxgpt`` or ``jaxgpt.config`` loads no framework (torch_ref shares the configs);
``build`` and the other entry points import JAX/Flax on first use.
"""
from jaxgpt.parallel.host_devices import default_host_devices

default_host_devices()  # before JAX starts: one CPU device per core (jaxgpt.parallel.host_devices)

from jaxgpt.config import PRESETS, BertConfig, EncDecConfig, ModelConfig, TrainConfig, get_preset  # noqa: E402 - after the setup above, which must run first

__all__ = ["PRESETS", "BertConfig", "EncDecConfig", "ModelConfig", "TrainConfig", "build", "get_preset"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "build":
        from jaxgpt.models import build

        return build
    raise AttributeError(f"module 'jaxgpt' has no attribute {name!r}")
