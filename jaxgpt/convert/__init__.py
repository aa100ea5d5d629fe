"""Weights in and out of jaxgpt.

- ``rule``: the generic, strict torch-state-dict <-> Flax-params rule (torch_ref layouts).
- ``common``: the shared renaming helper and the option/field tables that make every external
  conversion exact or refused (all offending options named in one ValueError).
- one module per external family: ``hf`` (directories: config.json + safetensors, sharded or not;
  live transformers models), ``gpt2``, ``llama`` (also Qwen2, Mistral), ``bert``, ``nanogpt``,
  ``seeds`` (seed 000 / 002 / 003 / 004 models).
- ``hf_files``: an HF directory's tokenizer, chat template, special ids and generation config,
  written from the tokenizer a checkpoint carries (``ExportWarning`` where HF has no class for it).
- ``files``: jaxgpt safetensors and the format dispatch behind ``jaxgpt convert``.
Importing jaxgpt.convert never imports torch or transformers; ``load_hf`` / ``save_hf`` never do.
"""
from jaxgpt.convert.files import load_safetensors, save_safetensors
from jaxgpt.convert.hf import from_hf, load_hf, save_hf, to_hf
from jaxgpt.convert.hf_files import ExportWarning
from jaxgpt.convert.nanogpt import from_nanogpt
from jaxgpt.convert.rule import params_to_state_dict, state_dict_to_params, to_numpy
from jaxgpt.convert.seeds import from_seed_attnres, from_seed_gpt, from_seed_minibert, from_seed_minigpt
from jaxgpt.models import abstract_params, count_params

__all__ = ["ExportWarning", "abstract_params", "count_params", "from_hf", "from_nanogpt", "from_seed_attnres", "from_seed_gpt",
           "from_seed_minibert", "from_seed_minigpt", "load_hf", "load_safetensors", "params_to_state_dict",
           "save_hf", "save_safetensors", "state_dict_to_params", "to_hf", "to_numpy"]
from jaxgpt.convert import torch_nn  # noqa: F401  torch nn.Transformer / Encoder/DecoderLayer state dicts (seed 004)
