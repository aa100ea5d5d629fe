"""What every external-format converter shares: key renaming onto the torch_ref layout, the strict
load into Flax params, and the two option tables that keep conversions exact.

- Import: an HF ``config.json`` dict (or ``model.config.to_dict()``, the same thing) is checked key
  by key against a family's ``Option`` table; unknown keys and unsupported values are named, all of
  them, in one ValueError.
- Export: every ModelConfig field has a ``Field`` rule per family ("maps to HF option X", "must be
  V", "has no effect here"); a field without a rule is refused too, so a new field cannot slip
  through an exporter unnoticed.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig
from jaxgpt.convert.rule import state_dict_to_params, to_numpy
from jaxgpt.models import abstract_params, stacked_paths


def rename(sd: Mapping[str, Any], rules: list[tuple[str, str]], skip: Callable[[str], bool] = lambda k: False):
    """Apply the first matching (regex, replacement) to every key, as NumPy arrays (a NumPy array,
    a memory-mapped tensor included, is kept as it is: the strict rule copies it once); unmatched
    keys are kept as they are so the strict rule reports them as unexpected."""
    out = {}
    for key, value in sd.items():
        if skip(key):
            continue
        for pattern, repl in rules:
            if re.fullmatch(pattern, key):
                key = re.sub(pattern, repl, key)
                break
        out[key] = value if isinstance(value, np.ndarray) else to_numpy(value)
    return out


def rename_layers(ref: Mapping[str, np.ndarray], top: Mapping[str, str],
                  layer: Callable[[str, str, np.ndarray], tuple[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
    """torch_ref keys -> an external layout: ``top`` renames the keys outside the layers,
    ``layer(i, rest, array)`` those of ``layers.{i}.{rest}`` (-> (new key, array), or None to drop it)."""
    out = {}
    for key, a in ref.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if m is None:
            out[top[key]] = a
        elif (new := layer(*m.groups(), a)) is not None:
            out[new[0]] = new[1]
    return out


def split_packed(sd: dict, packed: str, sizes: tuple[int, int, int]) -> dict:
    """layers.{i}.attn.<packed>.{weight,bias} (rows [q; k; v]) -> q_proj / k_proj / v_proj."""
    for key in [k for k in sd if f".attn.{packed}." in k]:
        a = sd.pop(key)
        leaf = key.rsplit(".", 1)[1]
        for name, part in zip(("q_proj", "k_proj", "v_proj"), np.split(a, np.cumsum(sizes)[:2], axis=0)):
            sd[key.replace(f"attn.{packed}.{leaf}", f"attn.{name}.{leaf}")] = part
    return sd


def load_ref(config, sd: Mapping[str, Any], template: Mapping | None = None) -> dict:
    """torch_ref-layout state dict -> params of ``build(config)``, strictly (every bad key named)."""
    template = abstract_params(config) if template is None else template
    return state_dict_to_params(sd, template, stacked=stacked_paths(config))


# Import: config.json options -----------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """How one config.json key is handled: ``ok(value, whole dict)``; ``needs`` says what is accepted
    (or ``needs(value, whole dict)`` says it, naming what is wrong with this value)."""

    ok: Callable[[Any, Mapping[str, Any]], bool]
    needs: str | Callable[[Any, Mapping[str, Any]], str]


MAPPED = Option(lambda v, d: True, "")  # read into the jaxgpt config


def inert(why: str) -> Option:
    """An option with no effect on the weights or the logits (``why`` documents it)."""
    return Option(lambda v, d: True, why)


def equals(*values: Any) -> Option:
    return Option(lambda v, d: any(v == x and type(v) is type(x) or v is x for x in values),
                  " or ".join(repr(x) for x in values))


def one_of(values) -> Option:
    return Option(lambda v, d: v in values, f"one of {sorted(values)}")


# Keys every transformers config carries (tokens, generation defaults, labels, bookkeeping): they
# change neither the weights nor the logits of the architectures converted here.
GENERIC = {k: inert("transformers bookkeeping / generation default") for k in (
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_bfloat16", "torchscript",
    "tf_legacy_loss", "return_dict", "output_hidden_states", "output_attentions", "output_scores",
    "return_dict_in_generate", "use_cache", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "cross_attention_hidden_size",
    "gradient_checkpointing", "initializer_range", "is_decoder")}
GENERIC["pruned_heads"] = Option(lambda v, d: not v, "{} (pruned heads change the weight shapes)")
GENERIC["add_cross_attention"] = equals(False)


def padding_row(d: Mapping[str, Any], default: int | None = None) -> int | None:
    """config.json's pad_token_id as the embedding row torch's nn.Embedding(padding_idx) freezes (a
    negative id counts from the end of the table, as torch reads it); None: no padding row."""
    pad = d.get("pad_token_id", default)
    if pad is None or pad >= 0:
        return pad
    return pad + d.get("vocab_size", 0)


def check_options(d: Mapping[str, Any], table: Mapping[str, Option], family: str) -> None:
    """ValueError naming every unknown key and every unsupported value of an HF config dict."""
    table = {**GENERIC, **table}
    problems = []
    for key, value in d.items():
        if key.startswith("_"):
            continue  # private transformers state (_name_or_path, _attn_implementation, ...)
        if key not in table:
            problems.append(f"{key}={value!r} (an option jaxgpt does not implement)")
        elif not table[key].ok(value, d):
            needs = table[key].needs
            problems.append(f"{key}={value!r} (supported: {needs(value, d) if callable(needs) else needs})")
    if problems:
        raise ValueError(f"HF {family} config not supported exactly by jaxgpt: " + "; ".join(problems))


# Export: ModelConfig fields ------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """How one jaxgpt config field is expressed in an HF family: ``ok(value, config)``."""

    ok: Callable[[Any, Any], bool]
    needs: str


def maps_to(hf_key: str) -> Field:
    return Field(lambda v, c: True, f"-> {hf_key}")


def must_be(*values: Any) -> Field:
    return Field(lambda v, c: v in values, " or ".join(repr(x) for x in values))


def unused(why: str) -> Field:
    """A field without effect in this family's models (e.g. rope_base when pos='learned')."""
    return Field(lambda v, c: True, f"unused: {why}")


# A padded table is cut to its valid_vocab rows by export_hf (jaxgpt/convert/hf.py) before a family sees it.
UNPADDED = Field(lambda v, c: v is None, "None (save_hf / to_hf cut a padded table to its valid_vocab rows first)")
ATTNRES_UNUSED = {name: unused("residual must be 'standard'") for name in
                  ("attnres_variant", "attnres_blocks", "attnres_eps", "attnres_key_gain")}
# Gemma's fields (convert/gemma.py): every other family must leave them off.
# Families whose exporters write no sliding window (their models would lose it).
WINDOWLESS = {"sliding_window": must_be(None), "window_layers": must_be(None)}
GEMMA_ONLY = {"norm_unit_offset": must_be(False), "attn_scale": must_be(None), "attn_softcap": must_be(None),
              "logit_softcap": must_be(None), "rope_local_base": must_be(None)}
# The compute and storage dtypes: the same exported weights whatever their values (how jaxgpt compiles and
# computes, jaxgpt.config.Execution, is not in the ModelConfig at all).
ENGINE_UNUSED = {name: unused("engine knob (how jaxgpt computes), not part of the exported weights") for name in
                 ("dtype", "param_dtype")}


def check_fields(config, table: Mapping[str, Field], family: str, prefix: str = "") -> list[str]:
    """Problems (as 'field=value (needs ...)') for ``config``'s fields under ``table``; a field
    with no rule at all is a problem too."""
    problems = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        rule = table.get(f.name)
        if rule is None:
            problems.append(f"{prefix}{f.name}={value!r} (no rule for HF {family} export)")
        elif not rule.ok(value, config):
            problems.append(f"{prefix}{f.name}={value!r} (HF {family} needs {rule.needs})")
    return problems


def refuse(problems: list[str], family: str) -> None:
    if problems:
        raise ValueError(f"cannot export this config as HF {family} exactly: " + "; ".join(problems))


def default_kind(config) -> str:
    """The task a config's checkpoint serves: 'classify' (BERT), 'seq2seq' (encoder-decoder) or 'lm'."""
    return "classify" if isinstance(config, BertConfig) else "seq2seq" if isinstance(config, EncDecConfig) else "lm"
