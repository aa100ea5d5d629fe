"""torch entry points of the converter: move jaxgpt params into and out of torch_ref modules."""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from jaxgpt.core.layout import params_to_state_dict, stacked_paths, state_dict_to_params


def _default_stacked(module: nn.Module) -> tuple[str, ...]:
    """Whole models (torch_ref.build) stack their layers as jaxgpt's nn.scan does; parts do not."""
    from torch_ref.models import MODELS

    return stacked_paths(module.config) if isinstance(module, MODELS) else ()


def load_params(module: nn.Module, params: Mapping, *, stacked: Iterable[str] | None = None) -> nn.Module:
    """Copy Flax params into ``module`` (strict: every key must match). Returns the module.
    ``stacked`` defaults to the layer stacks of a whole model (``torch_ref.build(config)``)."""
    if stacked is None:
        stacked = _default_stacked(module)
    sd = {k: torch.from_numpy(v) for k, v in params_to_state_dict(params, stacked=stacked).items()}
    module.load_state_dict(sd, strict=True)
    return module


def module_params(module: nn.Module, template: Mapping, *, stacked: Iterable[str] | None = None) -> dict:
    """Flax params (NumPy leaves) holding ``module``'s weights, shaped like ``template``."""
    if stacked is None:
        stacked = _default_stacked(module)
    return state_dict_to_params(module.state_dict(), template, stacked=stacked)
