"""Weight files: jaxgpt safetensors, torch_ref ``.pt`` files, Hugging Face directories, nanoGPT
checkpoints and jaxgpt (orbax) checkpoints, read into and written from (config, params).

``load_weights`` / ``save_weights`` back ``jaxgpt convert``: every format goes through the same
(config, params, extras) triple, where extras carries the tokenizer and task kind when known.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flax import traverse_util

from jaxgpt.config import Execution, config_from_dict, split_execution
from jaxgpt.convert.common import default_kind
from jaxgpt.models import relayout, stacked_paths

FORMATS = ("jaxgpt", "safetensors", "torch", "hf", "nanogpt")


def save_safetensors(path: str, params: Mapping, config=None, extras: Mapping[str, Any] | None = None) -> None:
    """Write ``params`` (any pytree of arrays keyed by Flax paths) and, if given, its config and
    JSON-able extras (tokenizer, kind)."""
    from safetensors.numpy import save_file

    flat = {"/".join(k): np.ascontiguousarray(np.asarray(v)) for k, v in traverse_util.flatten_dict(dict(params)).items()}
    meta = {"format": "jaxgpt"} | ({"config": json.dumps(config.to_dict())} if config is not None else {})
    meta |= {k: json.dumps(v) for k, v in (extras or {}).items()}
    save_file(flat, str(path), metadata=meta)


def _saved_config(d: dict):
    """A saved model config; one written before Execution left ModelConfig drops its execution keys
    (the weights are the same whatever they were)."""
    return config_from_dict(split_execution(d)[0])


def load_safetensors(path: str, *, with_extras: bool = False):
    """(config or None, params) from a file written by ``save_safetensors`` (+ extras dict)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        flat = {tuple(k.split("/")): f.get_tensor(k) for k in f.keys()}
    config = _saved_config(json.loads(meta["config"])) if "config" in meta else None
    params = traverse_util.unflatten_dict(flat)
    if config is not None:  # whichever layout the writer ran: the default one's
        params = relayout(params, config, scanned=Execution.for_model(config).scan_layers)
    if not with_extras:
        return config, params
    return config, params, {k: json.loads(v) for k, v in meta.items() if k not in ("format", "config")}


def detect_format(path: str | Path) -> str:
    """The format of an existing file or directory, from its name and contents."""
    p = Path(path)
    if p.is_dir():
        if (p / "checkpoints").is_dir() or any(c.name.isdigit() for c in p.iterdir()):
            return "jaxgpt"
        if (p / "config.json").is_file():
            return "hf"
        raise ValueError(f"{str(p)!r} is neither a jaxgpt run/checkpoint directory nor a Hugging Face model "
                         "directory (no config.json)")
    if not p.exists():
        raise FileNotFoundError(f"no file or directory at {str(p)!r}")
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch"
    raise ValueError(f"cannot tell the format of {str(p)!r}: expected a directory, .safetensors or .pt")


def load_weights(path: str | Path, fmt: str | None = None) -> tuple[Any, dict, dict]:
    """-> (config, params, extras) from any supported format (detected unless ``fmt``)."""
    p = Path(path)
    fmt = fmt or detect_format(p)
    if fmt == "jaxgpt":
        from jaxgpt.train.checkpoint import Checkpoints

        config, params, meta = Checkpoints(p, create=False).restore_params()
        return config, params, {"tokenizer": meta.get("tokenizer"), "kind": meta.get("kind", default_kind(config))}
    if fmt == "safetensors":
        config, params, extras = load_safetensors(p, with_extras=True)
        if config is None:
            raise ValueError(f"{str(p)!r} has no jaxgpt config in its metadata (not written by save_safetensors)")
        return config, params, extras
    if fmt == "hf":
        from jaxgpt.convert.hf import load_hf

        return load_hf(p, with_extras=True)
    if fmt in ("torch", "nanogpt"):
        import torch

        from jaxgpt.convert.nanogpt import from_nanogpt
        from jaxgpt.convert.rule import state_dict_to_params
        from jaxgpt.models import abstract_params

        obj = torch.load(p, map_location="cpu", weights_only=False)
        if isinstance(obj, dict) and "model_args" in obj:
            config, params = from_nanogpt(obj)
            return config, params, {"kind": "lm"}
        if not (isinstance(obj, dict) and obj.get("format") == "torch_ref"):
            raise ValueError(f"{str(p)!r} is neither a torch_ref file (written by jaxgpt convert) nor a nanoGPT "
                             "checkpoint (with model_args)")
        config = _saved_config(obj["config"])
        params = state_dict_to_params(obj["state_dict"], abstract_params(config), stacked=stacked_paths(config))
        return config, params, {k: obj[k] for k in ("tokenizer", "kind") if k in obj}
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def save_weights(path: str | Path, fmt: str, config, params, extras: Mapping[str, Any] | None = None) -> None:
    """Write (config, params) as ``fmt``: 'jaxgpt' (a checkpoint directory at step 0),
    'safetensors', 'torch' (a torch_ref state dict + config) or 'hf' (``save_hf``: config.json + safetensors,
    and the tokenizer's files). Every format keeps ``extras['tokenizer']`` whole (an HF tokenizer's chat
    template, special ids and generation config included); where 'hf' cannot hold it, an ``ExportWarning``
    says what the directory lacks."""
    extras = {k: v for k, v in (extras or {}).items() if v is not None}
    p = Path(path)
    if fmt == "jaxgpt":
        from jaxgpt.config import TrainConfig
        from jaxgpt.train.checkpoint import Checkpoints
        from jaxgpt.train.step import init_state

        ckpts = Checkpoints(p)
        if ckpts.latest_step() is not None:
            raise ValueError(f"{str(p)!r} already holds checkpoints; convert into a new directory")
        tc = TrainConfig()
        ckpts.save(init_state(config, tc, params), {
            "config": config.to_dict(), "train": tc.to_dict(), "tokenizer": extras.get("tokenizer"),
            "source": f"converted:{extras.get('source', '')}", "kind": extras.get("kind", default_kind(config))})
        ckpts.wait()
    elif fmt == "safetensors":
        save_safetensors(p, params, config, {k: v for k, v in extras.items() if k in ("tokenizer", "kind")})
    elif fmt == "torch":
        import torch

        from jaxgpt.convert.rule import params_to_state_dict

        sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
              params_to_state_dict(params, stacked=stacked_paths(config)).items()}
        torch.save({"format": "torch_ref", "config": config.to_dict(), "state_dict": sd,
                    **{k: v for k, v in extras.items() if k in ("tokenizer", "kind")}}, p)
    elif fmt == "hf":
        from jaxgpt.convert.hf import save_hf
        from jaxgpt.convert.hf_files import ExportWarning

        if extras.get("tokenizer") is None:
            import warnings

            warnings.warn(f"no tokenizer came with these weights, so {p} gets no tokenizer files, special ids or "
                          "generation_config.json: prompts there need token ids and HF generate stops only at "
                          "max_new_tokens", ExportWarning, stacklevel=2)
        save_hf(p, config, params, tokenizer=extras.get("tokenizer"))
    else:
        raise ValueError(f"cannot write format {fmt!r}; expected one of {FORMATS[:4]}")
