"""Configs are values: frozen, validated dataclasses and named presets; no framework is imported.

- ``model``: ModelConfig (one stack), BertConfig, EncDecConfig and the option tables;
- ``train``: TrainConfig; ``presets``: PRESETS / get_preset; ``overrides``: ``--set key=value``;
- ``mesh``: the ``--mesh data=N,fsdp=M,tensor=K`` syntax.
"""
from jaxgpt.config.base import _Config
from jaxgpt.config.mesh import AXES, mesh_devices, parse_mesh
from jaxgpt.config.model import (ACT_IMPLS, ATTENTION_IMPLS, ATTNRES_VARIANTS, DTYPES, FLOAT32_EPS, MATMUL_PRECISIONS, MLPS,
                                 NORM_IMPLS, NORMS, PLACEMENTS, POOLERS, POS, REMATS, RESIDUALS, ROPE_LAYOUTS, BertConfig,
                                 EncDecConfig, ModelConfig, check_sampling, config_from_dict)
from jaxgpt.config.moe import MOE_IMPLS, MoEConfig
from jaxgpt.config.overrides import apply_sets, parse_value
from jaxgpt.config.presets import PRESETS, get_preset
from jaxgpt.config.train import DECAY, ON_NONFINITE, SCHEDULES, TOKENIZERS, TrainConfig

__all__ = ["ACT_IMPLS", "ATTENTION_IMPLS", "ATTNRES_VARIANTS", "AXES", "DECAY", "DTYPES", "FLOAT32_EPS", "MATMUL_PRECISIONS", "MLPS", "NORM_IMPLS", "NORMS",
           "ON_NONFINITE", "PLACEMENTS", "POOLERS", "POS", "PRESETS", "REMATS", "RESIDUALS", "ROPE_LAYOUTS",
           "SCHEDULES", "TOKENIZERS", "BertConfig", "EncDecConfig", "ModelConfig", "MoEConfig", "MOE_IMPLS", "TrainConfig", "_Config",
           "apply_sets", "check_sampling", "config_from_dict", "get_preset", "mesh_devices", "parse_mesh",
           "parse_value"]
