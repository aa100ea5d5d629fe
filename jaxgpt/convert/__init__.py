"""Weights in and out of jaxgpt.

- ``rule``: the generic, strict torch-state-dict <-> Flax-params rule (torch_ref layouts).
- ``external``: small key maps for HuggingFace GPT-2 / LLaMA / BERT, nanoGPT checkpoints and the
  seeds' own classes, each renamed onto the torch_ref layout and then put through the rule.
- ``files``: safetensors export/import of jaxgpt params.
jaxgpt never imports torch at import time: tensors are read as NumPy arrays.
"""
from jaxgpt.convert.external import (abstract_params, from_hf, from_nanogpt, from_seed_gpt, from_seed_minigpt,
                                     to_hf)
from jaxgpt.convert.bert import from_seed_minibert
from jaxgpt.convert.files import load_safetensors, save_safetensors
from jaxgpt.convert.seed002 import from_seed_attnres
from jaxgpt.convert.rule import params_to_state_dict, state_dict_to_params, to_numpy

__all__ = ["abstract_params", "from_hf", "from_seed_attnres", "from_seed_minibert", "from_nanogpt", "from_seed_gpt", "from_seed_minigpt", "load_safetensors",
           "params_to_state_dict", "save_safetensors", "state_dict_to_params", "to_hf", "to_numpy"]
