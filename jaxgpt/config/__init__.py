"""Configs are values: frozen, validated dataclasses and named presets; no framework is imported.

- ``model``: ModelConfig (one stack), BertConfig, EncDecConfig and the option tables;
- ``execution``: Execution, how a model is compiled and computed (kernels, scan, remat, precision);
- ``train``: TrainConfig and ``--init``'s defaults; ``presets``: PRESETS / get_preset / train_defaults;
- ``rope``: RopeScaling, the RoPE scaling variants (``ModelConfig.rope_scaling``);
- ``overrides``: ``--set key=value``;
- ``mesh``: the ``--mesh data=N,fsdp=M,tensor=K`` syntax.
"""
from jaxgpt.config.base import _Config
from jaxgpt.config.mesh import AXES, mesh_devices, parse_mesh
from jaxgpt.config.execution import (ACT_IMPLS, ATTENTION_IMPLS, MATMUL_PRECISIONS, NORM_IMPLS, REMATS, Execution,
                                     split_execution)
from jaxgpt.config.model import (ATTNRES_VARIANTS, DTYPES, FLOAT32_EPS, MLPS, NORMS, PLACEMENTS, POOLERS, POS, QK_NORMS,
                                 RESIDUALS, ROPE_LAYOUTS, BertConfig, EncDecConfig, ModelConfig, check_sampling,
                                 config_from_dict)
from jaxgpt.config.moe import MOE_IMPLS, MoEConfig
from jaxgpt.config.overrides import apply_sets, parse_value
from jaxgpt.config.presets import PRESETS, TRAIN_DEFAULTS, get_preset, train_defaults
from jaxgpt.config.rope import ROPE_TYPES, RopeScaling
from jaxgpt.config.train import DECAY, INIT_DEFAULTS, ON_NONFINITE, SCHEDULES, TOKENIZERS, TrainConfig, init_warmup

__all__ = ["ACT_IMPLS", "ATTENTION_IMPLS", "ATTNRES_VARIANTS", "AXES", "DECAY", "DTYPES", "Execution", "FLOAT32_EPS", "INIT_DEFAULTS",
           "MATMUL_PRECISIONS", "MLPS", "NORM_IMPLS", "NORMS", "ON_NONFINITE", "PLACEMENTS", "POOLERS", "POS", "PRESETS", "QK_NORMS",
           "REMATS", "RESIDUALS", "ROPE_LAYOUTS", "ROPE_TYPES", "RopeScaling", "TRAIN_DEFAULTS",
           "SCHEDULES", "TOKENIZERS", "BertConfig", "EncDecConfig", "ModelConfig", "MoEConfig", "MOE_IMPLS", "TrainConfig", "_Config",
           "apply_sets", "check_sampling", "config_from_dict", "get_preset", "init_warmup", "mesh_devices",
           "parse_mesh", "parse_value", "split_execution", "train_defaults"]
