"""safetensors export/import of jaxgpt params (Flax paths joined with '/'), config in metadata."""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
from flax import traverse_util

from jaxgpt.config import config_from_dict


def save_safetensors(path: str, params: Mapping, config=None) -> None:
    """Write ``params`` (any pytree of arrays keyed by Flax paths) and, if given, its config."""
    from safetensors.numpy import save_file

    flat = {"/".join(k): np.ascontiguousarray(np.asarray(v)) for k, v in traverse_util.flatten_dict(dict(params)).items()}
    meta = {"format": "jaxgpt"} | ({"config": json.dumps(config.to_dict())} if config is not None else {})
    save_file(flat, path, metadata=meta)


def load_safetensors(path: str) -> tuple[Any, dict]:
    """(config or None, params) from a file written by ``save_safetensors``."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        flat = {tuple(k.split("/")): f.get_tensor(k) for k in f.keys()}
    config = config_from_dict(json.loads(meta["config"])) if "config" in meta else None
    return config, traverse_util.unflatten_dict(flat)
