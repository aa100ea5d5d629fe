"""Hugging Face checkpoints in and out: directories (config.json + model.safetensors or a sharded
model.safetensors.index.json) read and written with safetensors' NumPy API, and live transformers
models (``from_hf`` / ``to_hf``). Directories never import torch or transformers.

A config.json dict and ``model.config.to_dict()`` are the same thing, so both paths share one
config mapping per family (``config_from_hf`` / ``config_to_hf`` in gpt2.py, llama.py, bert.py),
and both refuse every option they cannot reproduce exactly, all named in one ValueError.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from jaxgpt.config import BertConfig, ModelConfig
from jaxgpt.convert import bert, gemma, gpt2, gpt_neox, llama, mixtral, olmo2, phi3, qwen2_moe, qwen3
from jaxgpt.convert.common import default_kind
from jaxgpt.convert.hf_files import write_tokenizer
from jaxgpt.convert.rule import params_to_state_dict, to_numpy
from jaxgpt.models import abstract_params, stacked_paths

FAMILIES = {"gpt2": gpt2, "llama": llama, "qwen2": llama, "mistral": llama, "bert": bert, "mixtral": mixtral,
            "qwen2_moe": qwen2_moe, "qwen3": qwen3, "olmo2": olmo2,
            "gpt_neox": gpt_neox, "phi3": phi3, "gemma": gemma, "gemma2": gemma, "gemma3_text": gemma}
ARCHS = {"gpt2": gpt2.ARCHS, **{k: (v,) for k, v in llama.ARCHS.items()}, "bert": bert.ARCHS,
         "mixtral": mixtral.ARCHS, "qwen2_moe": qwen2_moe.ARCHS, "qwen3": qwen3.ARCHS, "olmo2": olmo2.ARCHS,
         "gpt_neox": gpt_neox.ARCHS, "phi3": phi3.ARCHS, **{k: (v,) for k, v in gemma.ARCHS.items()}}
# Decoder families that claim a config (``claims(config)``) before the LLaMA / GPT-2 defaults, on export
CLAIMING = (gemma, qwen3, olmo2, gpt_neox, phi3)  # in order: Gemma 3's q/k norms would read as Qwen3's
SUPPORTED = tuple(a for archs in ARCHS.values() for a in archs)
_DTYPES = ("float32", "bfloat16", "float16")  # what params may be loaded as and exported in
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _architecture(d: Mapping[str, Any], arch: str | None = None) -> tuple[Any, str]:
    """(family module, architecture) for an HF config dict, or a ValueError naming what is unsupported."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    arch = arch or (archs[0] if len(archs) == 1 else None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} (architectures={archs}) is not supported; supported model "
                         f"types: {sorted(FAMILIES)}")
    if arch not in ARCHS[model_type]:
        raise ValueError(f"architecture {arch!r} is not supported for model_type={model_type!r}; supported: "
                         f"{list(ARCHS[model_type])}")
    return FAMILIES[model_type], arch


def _config(d: Mapping[str, Any], arch: str | None, keys) -> tuple[Any, Any, str]:
    """(jaxgpt config, family module, architecture); every unsupported option refused at once.
    ``keys``: the checkpoint's tensor names (BERT's pooler is optional)."""
    family, arch = _architecture(d, arch)
    d = {k: v for k, v in d.items() if k != "architectures"}
    if family is bert:
        pooler = any(k.endswith("pooler.dense.weight") for k in keys)
        return bert.config_from_hf(d, arch, has_pooler=pooler), family, arch
    return family.config_from_hf(d, arch), family, arch


def _template(config, dtype) -> dict:
    """abstract_params in ``dtype`` (float32 by default): the strict loader casts every tensor to it."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.dtype(dtype or np.float32)), abstract_params(config))


def _dtype(dtype):
    """None -> float32 (the explicit upcast of bf16/fp16 checkpoints); else float32, bfloat16 or float16."""
    if dtype is None:
        return None
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    dt = np.dtype(dtype)
    if dt.name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {_DTYPES} (or None: float32)")
    return dt


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names shards that are not there: {missing}")
        return [path / f for f in files]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ValueError(f"{str(path)!r} has neither model.safetensors nor model.safetensors.index.json "
                     "(pytorch_model.bin checkpoints are not read: re-save them with safe_serialization)")


def load_hf(path: str | Path, dtype=None, *, with_extras: bool = False, mesh=None, shardings=None):
    """(config, params) from a Hugging Face model directory, without torch or transformers
    (``with_extras``: + an extras dict, ``{'kind', 'tokenizer'}``, the tokenizer a jaxgpt checkpoint
    keeps: tokenizer.json with the special ids, chat template, tokenizer_config.json and
    generation_config.json (``HFTokenizer.to_dict()``), or None without a tokenizer.json).

    Reads config.json and model.safetensors (or model.safetensors.index.json and its shards),
    memory-mapped: each tensor is copied once, transposed and cast on the way, into the params'
    preallocated arrays (stacked layers filled layer by layer), so a load holds the params plus
    about one chunk of a tensor (jaxgpt/convert/stream.py). Families: GPT-2 (GPT2LMHeadModel,
    GPT2Model), LLaMA, Qwen2, Mistral, Mixtral, Qwen2-MoE, Qwen3, OLMo 2, GPT-NeoX, Phi-3, Gemma,
    Gemma 2 (*ForCausalLM) and BERT (BertModel, BertForSequenceClassification); any other
    model_type / architecture, and any option jaxgpt does
    not reproduce exactly, is a ValueError naming it. ``dtype=None`` upcasts bf16/fp16 checkpoints
    to float32 (exact); ``dtype='bfloat16'`` (or any NumPy dtype) gives params in that dtype.

    ``mesh`` (a ``jaxgpt.parallel.sharding.make_mesh`` Mesh): params come back as ``jax.Array`` s
    placed by ``param_shardings`` (or by ``shardings``, a tree of Shardings like the params), each
    built with ``jax.make_array_from_callback`` from only its devices' slices of the mapped files.
    Without either, params are NumPy arrays.
    """
    from jaxgpt.convert.stream import open_safetensors, sharded_template

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model directory: no config.json")
    d = json.loads((path / "config.json").read_text())
    _architecture(d)  # refuse unknown families before opening any weights
    dt = _dtype(dtype)
    tensors = {}
    for shard in _shards(path):  # headers only: the config is checked before any tensor is read
        tensors.update(open_safetensors(shard))
    config, family, arch = _config(d, None, tensors)
    template = _template(config, dt)
    if mesh is not None or shardings is not None:
        if shardings is None:
            from jaxgpt.parallel.sharding import param_shardings

            shardings = param_shardings(config, template, mesh)
        template = sharded_template(template, shardings)
    params = family.params_from_hf(config, tensors, arch, template)
    if not with_extras:
        return config, params
    from jaxgpt.data.hf_tokenizer import tokenizer_dict

    return config, params, {"kind": default_kind(config), "tokenizer": tokenizer_dict(path)}


def _family_of(config) -> Any:
    if isinstance(config, BertConfig):
        return bert
    if not isinstance(config, ModelConfig):
        raise ValueError(f"Hugging Face export supports decoder (ModelConfig) and BERT configs, got "
                         f"{type(config).__name__}")
    if config.moe is not None:  # a shared expert is Qwen2-MoE's; Mixtral has none
        return qwen2_moe if config.moe.shared_d_ff else mixtral
    for family in CLAIMING:
        if family.claims(config):
            return family
    if config.pos == "rope":
        return llama
    if config.pos == "learned":
        return gpt2
    raise ValueError(f"no Hugging Face family has pos={config.pos!r}: GPT-2 needs pos='learned', LLaMA/Qwen2 "
                     "pos='rope'")


def unpad_vocab(config: ModelConfig, params: Mapping) -> tuple[ModelConfig, dict]:
    """A padded vocabulary (``valid_vocab``) cut to its tokens: the first valid_vocab rows of tok_embed and
    columns of lm_head. The padded rows never reach a probability, so the logits of every token are
    unchanged; HF checkpoints (GPT-2's 50257) keep the tokenizer's vocabulary."""
    v = config.valid_vocab
    if v is None:
        return config, dict(params)
    out = {**params, "tok_embed": {**params["tok_embed"], "embedding": params["tok_embed"]["embedding"][:v]}}
    if "lm_head" in params:
        out["lm_head"] = {k: a[..., :v] for k, a in params["lm_head"].items()}  # kernel (d, V), bias (V,)
    return config.replace(vocab_size=v, valid_vocab=None), out


def _export_views(config, params: Mapping) -> tuple[dict[str, Any], dict[str, np.ndarray], np.dtype]:
    """(HF config dict, HF state dict as views of the params, the dtype it is written in)."""
    if isinstance(config, ModelConfig):
        config, params = unpad_vocab(config, params)
    family = _family_of(config)
    with_classifier = "classifier" in params
    d = bert.config_to_hf(config, with_classifier) if family is bert else family.config_to_hf(config)  # refuses first
    ref = params_to_state_dict(params, stacked=stacked_paths(config), views=True)
    sd = bert.params_to_hf(config, ref, with_classifier) if family is bert else family.params_to_hf(config, ref)
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(params)}
    dtype = dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)).name in _DTYPES else np.dtype(np.float32)
    d["torch_dtype"] = d["dtype"] = dtype.name  # older transformers read torch_dtype, newer dtype
    return d, sd, dtype


def export_hf(config, params: Mapping) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(HF config dict, HF state dict as NumPy arrays in the params' dtype); refuses inexact configs.
    A padded vocabulary is written as its valid_vocab tokens (``unpad_vocab``)."""
    from jaxgpt.convert.stream import contiguous

    d, sd, dtype = _export_views(config, params)
    return d, {k: contiguous(v, dtype) for k, v in sd.items()}


def _size(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int) and max_shard_size > 0:
        return max_shard_size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", str(max_shard_size).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} is not a positive size like 500MB, 5GB or 10**9")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def save_hf(path: str | Path, config, params: Mapping, tokenizer=None, max_shard_size: int | str = "5GB") -> None:
    """Write a Hugging Face model directory, without torch or transformers: config.json (model_type,
    architectures, torch_dtype) and model.safetensors, or model-0000i-of-0000n.safetensors shards
    with model.safetensors.index.json when the weights exceed ``max_shard_size`` (bytes, or '500MB').
    ``transformers.AutoModelForCausalLM`` / ``BertForSequenceClassification.from_pretrained(path)`` load it.

    ``tokenizer`` (``hf_files.write_tokenizer``): a jaxgpt tokenizer or its ``to_dict()`` (an HF
    directory's comes back as it was read: tokenizer.json, tokenizer_config.json, chat template,
    generation_config.json, and its bos/eos/pad ids in config.json; a character tokenizer has no HF
    class: an ExportWarning names it), a ``tokenizers.Tokenizer`` (tokenizer.json) or anything with
    ``save_pretrained(dir)`` (a transformers tokenizer). Configs HF cannot express exactly are refused.
    """
    from jaxgpt.convert.stream import write_shards

    limit = _size(max_shard_size)
    d, views, dtype = _export_views(config, params)  # refused here, before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:  # the model's own pad row (config_to_hf's pad_token_id) wins over the tokenizer's
        d.update({k: v for k, v in write_tokenizer(path, tokenizer).items() if d.get(k) is None})
    write_shards(path, views, dtype, limit)  # a chunk at a time: the params plus about one chunk in memory
    (path / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


# Live transformers models ---------------------------------------------------------------------
def from_hf(hf_model, dtype=None) -> tuple[Any, dict]:
    """A transformers model (GPT2LMHeadModel, GPT2Model, BertModel, BertForSequenceClassification, or a
    causal LM of the families in ``SUPPORTED``: LLaMA, Qwen2, Mistral, Mixtral, Qwen2-MoE, Qwen3, OLMo 2,
    GPT-NeoX, Phi-3) -> (jaxgpt config, params)."""
    arch = type(hf_model).__name__
    if arch not in SUPPORTED:
        raise ValueError(f"from_hf supports {list(SUPPORTED)}, got {arch}")
    names = dict(hf_model.named_parameters())  # no buffers; a tied lm_head appears once, as the embedding
    tensors = {k: v for k, v in hf_model.state_dict().items() if k in names}
    config, family, arch = _config(hf_model.config.to_dict(), arch, tensors)
    return config, family.params_from_hf(config, tensors, arch, _template(config, _dtype(dtype)))


def to_hf(config, params: Mapping, *, attn_implementation: str = "eager"):
    """jaxgpt (config, params) -> a transformers model holding the same weights (eval mode); configs
    that HF cannot express exactly are refused, every offending field named."""
    import torch
    import transformers

    d, sd = export_hf(config, params)
    arch = d.pop("architectures")[0]
    if d["model_type"] in ("mixtral", "qwen2_moe", "gpt_neox"):
        # transformers 5 fuses the experts in memory (gate_up_proj) and renames GPT-NeoX's embed_out to
        # lm_head, converting the saved layout only while loading a directory: go through one.
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            save_hf(tmp, config, params)
            return getattr(transformers, arch).from_pretrained(tmp, attn_implementation=attn_implementation).eval()
    kwargs = {k: v for k, v in d.items() if k not in ("model_type", "dtype", "torch_dtype")}
    hc = transformers.AutoConfig.for_model(d["model_type"], attn_implementation=attn_implementation, **kwargs)
    model = getattr(transformers, arch)(hc)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(d["dtype"], torch.float32)
    model = model.to(dtype)
    tensors = {k: torch.from_numpy(to_numpy(v)).to(dtype) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    buffers = {k for k, _ in model.named_buffers()}
    tied = {"lm_head.weight"} if getattr(hc, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in buffers and k not in tied]
    if missing or unexpected:
        raise ValueError(f"params do not match HF {arch}: missing {missing}, unexpected {list(unexpected)}")
    if tied:
        model.tie_weights()
    return model.eval()
