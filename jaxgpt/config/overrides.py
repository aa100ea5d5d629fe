"""``--set key=value`` overrides: text -> typed values -> (model config, TrainConfig).

Execution keys (``exec.attention_impl=ffi``, or the bare ``attention_impl=ffi`` written before they
left ModelConfig) go to ``TrainConfig.execution``."""
from __future__ import annotations

import dataclasses

from jaxgpt.config.execution import EXECUTION_FIELDS, Execution
from jaxgpt.config.model import EncDecConfig, ModelConfig
from jaxgpt.config.moe import MoEConfig
from jaxgpt.config.train import TrainConfig


def parse_value(text: str):
    """'3' -> 3, '1e-3' -> 0.001, 'true'/'false'/'none' -> bool/None, anything else -> the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _as_field(cls, name: str, raw: str, value):
    """A string field keeps the text as typed ('none' is a value of ``pos``, '1' could be a name)."""
    return raw if cls.field_types()[name] == (str,) else value


def parse_sets(items: list[str]) -> list[tuple[str, str]]:
    """``--set`` items -> (key, value text) pairs in order (a later key wins where they are applied)."""
    pairs = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        pairs.append((key, raw))
    return pairs


def apply_sets(config, items: list[str], train_defaults: dict | None = None) -> tuple[object, TrainConfig]:
    """``key=value`` settings -> (model config, TrainConfig). Training keys go to TrainConfig, over
    ``train_defaults`` (TrainConfig fields: a preset's ``train_defaults``, ``--init``'s INIT_DEFAULTS),
    themselves over TrainConfig's own defaults; model keys to the config (BERT: its own fields or the
    encoder's; encoder-decoder: both stacks, or one with an ``encoder.``/``decoder.`` prefix); execution
    keys (``exec.name``, or ``name``) to ``TrainConfig.execution``, over the defaults' execution."""
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    own = {f.name for f in dataclasses.fields(config)} - {"encoder", "decoder"}
    train: dict = {}
    model: dict[str, dict] = {}
    moe_sets: dict = {}
    exec_sets: dict = {}
    for key, raw in parse_sets(items):
        value = parse_value(raw)
        name = key.removeprefix("exec.").rpartition(".")[2]  # model.attention_impl, decoder.scan_layers: one Execution
        if key.startswith("exec.") or name in EXECUTION_FIELDS:
            if name not in {f.name for f in dataclasses.fields(Execution)}:
                raise ValueError(f"unknown setting {key!r}; execution keys: "
                                 f"{', '.join('exec.' + f.name for f in dataclasses.fields(Execution))}")
            exec_sets[name] = _as_field(Execution, name, raw, value)
            continue
        if key in train_fields:
            train[key] = _as_field(TrainConfig, key, raw, value)
            continue
        if isinstance(config, ModelConfig) and key.startswith("moe."):  # moe.n_experts=8, moe.dense_layers=0;3
            name = key[4:]
            if name not in {f.name for f in dataclasses.fields(MoEConfig)}:
                raise ValueError(f"unknown setting {key!r}; MoE keys: "
                                 f"{', '.join('moe.' + f.name for f in dataclasses.fields(MoEConfig))}")
            if name == "dense_layers":
                value = tuple(int(v) for v in raw.replace(",", ";").split(";") if v.strip())
            moe_sets[name] = _as_field(MoEConfig, name, raw, value)
            continue
        target, _, name = key.rpartition(".")
        if name in model_fields:
            value = _as_field(ModelConfig, name, raw, value)
        elif name in own:
            value = _as_field(type(config), name, raw, value)
        if isinstance(config, ModelConfig) and not target and name in model_fields:
            model.setdefault("", {})[name] = value
        elif not isinstance(config, ModelConfig) and not target and name in own:
            model.setdefault("self", {})[name] = value
        elif not isinstance(config, ModelConfig) and name in model_fields and target in ("", "encoder", "decoder"):
            stacks = [target] if target else ["encoder"] + (["decoder"] if isinstance(config, EncDecConfig) else [])
            if target == "decoder" and not isinstance(config, EncDecConfig):
                raise ValueError(f"{key!r}: a {type(config).__name__} has no decoder")
            for stack in stacks:
                model.setdefault(stack, {})[name] = value
        else:
            raise ValueError(f"unknown setting {key!r}; training keys: {', '.join(sorted(train_fields))}; "
                             f"model keys: {', '.join(sorted(model_fields | own))}")
    if moe_sets:  # on top of the config's MoEConfig, or of MoEConfig's defaults
        model.setdefault("", {})["moe"] = (config.moe or MoEConfig()).replace(**moe_sets)
    if "" in model:
        config = config.replace(**model[""])
    nested = {stack: getattr(config, stack).replace(**model[stack]) for stack in ("encoder", "decoder") if stack in model}
    if nested or "self" in model:
        config = config.replace(**nested, **model.get("self", {}))
    tc = TrainConfig(**{**(train_defaults or {}), **train})
    if not exec_sets:
        return config, tc
    return config, tc.replace(execution=Execution.for_model(config, tc.execution).replace(**exec_sets))


