"""jaxgpt: functional Flax transformers with a mirrored PyTorch reference (torch_ref).

Importing ``jaxgpt`` or ``jaxgpt.config`` loads no framework (torch_ref shares the configs) and changes
no environment variable; ``build`` and the other entry points import JAX/Flax on first use.
``use_host_devices()``, called before JAX starts, splits a CPU into one device per core, as the
``jaxgpt`` command and ``jaxgpt.train.fit`` do (jaxgpt.parallel.host_devices).
"""
from jaxgpt.config import PRESETS, BertConfig, EncDecConfig, Execution, ModelConfig, TrainConfig, get_preset
from jaxgpt.core.constants import __version__  # noqa: F401
from jaxgpt.parallel.host_devices import use_host_devices

__all__ = ["PRESETS", "BertConfig", "EncDecConfig", "Execution", "ModelConfig", "TrainConfig", "build", "get_preset",
           "use_host_devices"]


def __getattr__(name: str):
    if name == "build":
        from jaxgpt.models import build

        return build
    raise AttributeError(f"module 'jaxgpt' has no attribute {name!r}")
