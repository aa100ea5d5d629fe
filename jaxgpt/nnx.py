"""jaxgpt models as Flax NNX modules, for code written against ``flax.nnx``.

Every model ``jaxgpt.models.build`` makes (DecoderLM: GPT-2, LLaMA, the seeds, MoE; BertClassifier;
EncoderDecoder) is wrapped by ``flax.nnx.bridge.ToNNX``: the NNX module runs the linen module's own
``apply``, so its outputs are the linen model's bit for bit, and its ``nnx.Param`` state is the linen
params dict, one Param per array, under the same names::

    import jaxgpt.nnx as jnnx                     # not `from jaxgpt import nnx`: it would shadow flax.nnx
    config, model = jnnx.from_preset("llama-tiny")
    logits = model(tokens)                        # (B, T) int ids -> (B, T, vocab) float32
    params = jnnx.to_params(model)                # {'tok_embed': {'embedding': ...}, ...}: what generate,
                                                  # serve, fit and the converters take

The call takes the linen ``__call__``'s arguments (``DecoderLM``: ``positions``, ``cache``, ``mask``,
``logits_at``, ...) and returns what it returns: logits, or a DecoderOutput when a cache is passed.
``deterministic=False`` turns dropout on; every call then draws one key from the module's 'dropout'
stream. ``loss(model, batch, train=True)`` is fit's loss (``jaxgpt.train.losses.loss_terms``) on the
module, and the optimizer ``nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)`` is fit's: the
weight-decay mask (``jaxgpt.train.optim.decay_mask``) reads an NNX state's names as it reads params.

Seeds follow ``jaxgpt.train.init_state``: ``from_config(config, seed=s)`` holds the weights that
``jaxgpt train --set seed=s`` starts from, and its dropout stream's i-th key is the key fit's step i
draws (``fold_in(state.rng, i)``), so a loop that calls ``loss(..., train=True)`` once a step drops
the units fit drops.

``to_params`` returns the module's own arrays (no copy): jaxgpt.train's steps donate their state,
so copy them (``jax.tree.map(jnp.copy, ...)``) before handing them to a train step if the module is
used afterwards.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig, TrainConfig, get_preset
from jaxgpt.core.layout import flatten, unflatten
from jaxgpt.models import abstract_params, build, init_params

Config = ModelConfig | BertConfig | EncDecConfig

__all__ = ["config_of", "from_config", "from_hf", "from_params", "from_preset", "loss", "to_params"]


def _keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, dropout key) of ``seed``, as ``jaxgpt.train.init_state`` derives them."""
    key = jax.random.PRNGKey(seed)
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def _check_params(config: Config, params: Mapping) -> dict:
    """params as plain nested dicts, after checking their names and shapes against ``config``'s model."""
    want = {k: s.shape for k, s in flatten(abstract_params(config)).items()}
    got = flatten(params)
    missing = sorted("/".join(k) for k in want.keys() - got.keys())
    unexpected = sorted("/".join(k) for k in got.keys() - want.keys())
    bad = [f"{'/'.join(k)}: got {tuple(jnp.shape(got[k]))}, expected {want[k]}"
           for k in want.keys() & got.keys() if tuple(jnp.shape(got[k])) != want[k]]
    if missing or unexpected or bad:
        parts = [f"{what} {names}" for what, names in (("missing", missing), ("unexpected", unexpected),
                                                       ("shape mismatches", sorted(bad))) if names]
        raise ValueError(f"params do not match the {type(build(config)).__name__} of this config: " + "; ".join(parts))
    return unflatten({k: jnp.asarray(a) for k, a in got.items()})


def from_params(config: Config, params: Mapping, *, seed: int = 0) -> nnx.Module:
    """The NNX module of ``build(config)`` holding ``params`` (a linen params dict: from ``init_params``,
    ``load_hf``, ``load_weights``, a checkpoint, ``to_params``). The arrays are used as they are (NumPy
    arrays become jax Arrays; nothing is cast), so ``to_params(from_params(config, p))`` is ``p`` bit
    for bit. Names and shapes are checked: every missing, unexpected or mis-shaped entry is named in
    one ValueError. ``seed``: the dropout stream (``from_config``)."""
    params = _check_params(config, params)
    model = bridge.ToNNX(build(config), rngs=nnx.Rngs(0))
    # ToNNX forks the Rngs it is given; this stream's i-th key is fold_in(dropout key, i), fit's step-i key
    model.to_nnx__rngs = nnx.Rngs(dropout=_keys(seed)[1])
    # the attributes ToNNX's lazy_init would set from a linen init: one per top-level name, Params inside
    for name, tree in bridge.variables.linen_vars_to_nnx_attrs({"params": params}).items():
        setattr(model, name, nnx.data(tree))
    return model


def from_config(config: Config, *, seed: int = 0) -> nnx.Module:
    """A freshly initialised NNX module for ``config``: the weights ``jaxgpt.train.init_state(config,
    TrainConfig(seed=seed))`` starts from (``init_params`` under jit, key ``fold_in(PRNGKey(seed), 0)``)."""
    return from_params(config, jax.jit(init_params, static_argnums=0)(config, _keys(seed)[0]), seed=seed)


def from_preset(name: str, *, seed: int = 0, **overrides: Any) -> tuple[Config, nnx.Module]:
    """(config, freshly initialised module) for preset ``name`` with ``overrides`` applied to its
    config (``get_preset(name).replace(**overrides)``; BERT and encoder-decoder presets take their
    own fields). The config comes first, as from ``load_hf``: generate and the converters need it."""
    config = get_preset(name).replace(**overrides)
    return config, from_config(config, seed=seed)


def from_hf(path: str | Path, dtype=None, *, seed: int = 0) -> tuple[Config, nnx.Module]:
    """(config, module) from a Hugging Face model directory, through ``jaxgpt.convert.load_hf`` (the
    families and refusals listed there; ``dtype=None`` reads float32). Other formats (jaxgpt
    checkpoints, safetensors, torch_ref and nanoGPT files): ``config, params, _ =
    jaxgpt.convert.files.load_weights(path)``, then ``from_params(config, params)``."""
    from jaxgpt.convert import load_hf

    config, params = load_hf(path, dtype)
    return config, from_params(config, params, seed=seed)


def to_params(model: nnx.Module) -> dict:
    """The linen params dict of a module from this file (its ``nnx.Param`` values, nested dicts of
    jax Arrays, the module's own arrays): what ``jaxgpt.inference.generate.generate``, ``init_state`` /
    ``fit``, ``jaxgpt.convert.save_hf`` and ``save_weights`` take."""
    config_of(model)  # a jaxgpt module: its Params are exactly the linen params
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def config_of(model: nnx.Module) -> Config:
    """The config a module from this file was built for."""
    inner = getattr(model, "to_nnx__module", None)
    config = getattr(inner, "config", None)
    if not isinstance(config, (ModelConfig, BertConfig, EncDecConfig)):
        raise TypeError(f"expected a module from jaxgpt.nnx (from_config, from_params, ...), got {type(model).__name__}"
                        + ("" if inner is None else f" wrapping {type(inner).__name__}"))
    return config


def loss(model: nnx.Module, batch: Mapping, train: bool = False, tc: TrainConfig | None = None) -> jax.Array:
    """The mean loss fit optimises on one ``batch`` (the model kind's dict, ``jaxgpt.data.batch_keys``:
    language models {'x', 'y'} (B, T) int32, targets -100 ignored): ``loss_terms`` on the module's
    params, then ``objective`` (MoE models add the router losses with ``tc``'s coefficients, default
    ``TrainConfig()``) over the target count. ``train``: dropout on, with the next key of the module's
    'dropout' stream. Differentiable with ``nnx.grad`` / ``nnx.value_and_grad``."""
    from jaxgpt.train.losses import loss_terms, objective

    config = config_of(model)
    rng = model.to_nnx__rngs.dropout() if train else None
    terms = loss_terms(config, to_params(model), dict(batch), rng=rng, train=train)
    return objective(terms, tc or TrainConfig(), config) / jnp.maximum(terms["count"], 1)
