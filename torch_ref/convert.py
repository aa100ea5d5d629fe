"""torch entry points of the converter: move jaxgpt params into and out of torch_ref modules."""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from jaxgpt.convert import params_to_state_dict, state_dict_to_params


def load_params(module: nn.Module, params: Mapping, *, stacked: Iterable[str] = ()) -> nn.Module:
    """Copy Flax params into ``module`` (strict: every key must match). Returns the module."""
    sd = {k: torch.from_numpy(v) for k, v in params_to_state_dict(params, stacked=stacked).items()}
    module.load_state_dict(sd, strict=True)
    return module


def module_params(module: nn.Module, template: Mapping, *, stacked: Iterable[str] = ()) -> dict:
    """Flax params (NumPy leaves) holding ``module``'s weights, shaped like ``template``."""
    return state_dict_to_params(module.state_dict(), template, stacked=stacked)
