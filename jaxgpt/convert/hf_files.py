"""What a Hugging Face directory holds besides its weights, written from the tokenizer a jaxgpt
checkpoint carries: tokenizer.json, tokenizer_config.json (special tokens, added tokens), the chat
template, special_tokens_map.json where the source had one, generation_config.json (special ids and
the source's sampling defaults), and the bos/eos/pad ids for config.json.

An HF tokenizer (``HFTokenizer``, read from an HF directory, kept through checkpoints and fine-tuning)
writes its files back verbatim; jaxgpt's byte-level BPE becomes a ``PreTrainedTokenizerFast``.
Character, pair and id-only tokenizers have no Hugging Face class: their weights still export, with
an ``ExportWarning`` naming what the directory lacks. Never imports torch or transformers.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ExportWarning(UserWarning):
    """A piece of the source the Hugging Face directory cannot hold (named in the message)."""


def _json_text(d: dict) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def _one_or_list(ids: list[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def _hf_files(d: dict) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """An 'hf' tokenizer dict -> (files, config.json ids, generation ids)."""
    gen = {k: _one_or_list(v) for k, v in (d.get("specials") or {}).items() if v}
    files = {"tokenizer.json": d["json"], **(d.get("files") or {})}
    if "tokenizer_config.json" not in files:  # a directory that had tokenizer.json alone
        files["tokenizer_config.json"] = _json_text({"tokenizer_class": "PreTrainedTokenizerFast",
                                                     **(d.get("special_tokens") or {})})
    ids = d.get("config_ids")
    return files, gen if ids is None else dict(ids), gen


def _named_ids(tok) -> dict[str, int]:
    """bos/eos/pad ids a tokenizer object names (``bos_id`` or transformers' ``bos_token_id``)."""
    out = {}
    for key in ID_KEYS:
        i = getattr(tok, key.replace("_token", ""), getattr(tok, key, None))
        if isinstance(i, int):
            out[key] = i
    return out


def write_tokenizer(path: str | Path, tokenizer) -> dict[str, Any]:
    """Write ``tokenizer``'s files into the HF directory ``path``; returns the special ids config.json
    should hold. ``tokenizer``: a jaxgpt tokenizer or its ``to_dict()`` (what checkpoints store), a
    ``tokenizers.Tokenizer`` (tokenizer.json alone) or a transformers tokenizer (``save_pretrained``)."""
    path = Path(path)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(path))
        files, ids = {}, _named_ids(tokenizer)
        gen = ids
    elif type(tokenizer).__module__.startswith("tokenizers"):
        files, ids, gen = {"tokenizer.json": tokenizer.to_str()}, {}, {}
    else:
        files, ids, gen = _from_dict(path, tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else tokenizer)
    if gen and "generation_config.json" not in files:
        files["generation_config.json"] = _json_text(gen)
    for name, text in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:  # a crafted checkpoint must not write elsewhere
            raise ValueError(f"tokenizer file name {name!r} leaves the directory {str(path)!r}")
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return ids


def _from_dict(path: Path, d) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """A jaxgpt tokenizer dict -> (files, config.json ids, generation ids); warns where HF has no class."""
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        raise ValueError(f"tokenizer must be a jaxgpt tokenizer (or its to_dict()), a tokenizers.Tokenizer or have "
                         f"save_pretrained(dir), got {type(d).__name__} {str(d)[:60]}")
    if d["kind"] == "hf":
        return _hf_files(d)
    if d["kind"] == "bpe":  # jaxgpt's byte-level BPE: no special tokens
        return {"tokenizer.json": d["json"],
                "tokenizer_config.json": _json_text({"tokenizer_class": "PreTrainedTokenizerFast"})}, {}, {}
    from jaxgpt.data.tokenizers import tokenizer_from_dict

    ids = _named_ids(tokenizer_from_dict(d))
    kept = f"; its special ids {ids} are kept" if ids else ""
    warnings.warn(f"the {d['kind']!r} tokenizer has no Hugging Face class, so {path} gets no tokenizer files: "
                  f"AutoTokenizer cannot load it and prompts there need token ids{kept}", ExportWarning, stacklevel=4)
    return {}, ids, ids
