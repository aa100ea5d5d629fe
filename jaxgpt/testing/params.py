"""Parameters for parity tests: random weights at meaningful scales, and moving parameter and gradient
trees between jaxgpt (Flax trees, ``kernel`` (in, out)) and a torch twin (``weight`` (out, in)), both ways,
by the one layout rule of ``jaxgpt.core.layout``.

Initial weights hide bugs (norm scales all ones, biases all zeros, tiny projections), so the tests use
``randomize``: every tensor drawn at a scale that keeps activations near unit scale. torch is imported
inside the functions that take a torch module.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.core.layout import params_to_state_dict, state_dict_to_params

_seed_offset = 0  # set_seed_offset: added to every randomize seed


def set_seed_offset(offset: int) -> int:
    """Add ``offset`` to the seed of every later ``randomize`` (to measure a suite's margins at other
    weight draws without editing its tests). Returns the previous offset."""
    global _seed_offset
    previous, _seed_offset = _seed_offset, int(offset)
    return previous


def randomize(params, seed: int = 0):
    """``params`` with every leaf redrawn (float32), shape and structure kept: Dense kernels (and MoE
    experts' ``gate_proj``/``up_proj``/``down_proj``, (E, in, out)) N(0, 1/fan_in); embeddings N(0, 1/d)
    (a tied output head keeps unit-scale logits); norm scales 1 + N(0, 1/4); everything else N(0, 1/4),
    so biases are not zeros and a bug in either shows up."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed + _seed_offset)
    out = []
    for path, leaf in leaves:
        name = getattr(path[-1], "key", "")
        shape = np.shape(leaf)
        if name in ("kernel", "gate_proj", "up_proj", "down_proj"):
            v = rng.standard_normal(shape) / np.sqrt(shape[-2])
        elif name == "embedding":
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif name == "scale":
            v = 1.0 + 0.5 * rng.standard_normal(shape)
        else:
            v = 0.5 * rng.standard_normal(shape)
        out.append(jnp.asarray(v, jnp.float32))
    return jax.tree_util.tree_unflatten(tree, out)


def random_params(module, *inputs, seed: int = 0, **kwargs):
    """``randomize``d params for ``module.init(key, *inputs, **kwargs)``, without running the init:
    only its shapes are traced (``jax.eval_shape``), so no op is compiled or executed."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs, **kwargs))["params"]
    return randomize(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), seed)


# -- jaxgpt trees <-> a torch twin ------------------------------------------------------------------
def load_into(torch_module, params: Mapping, stacked: Iterable[str] = ()):
    """Copy the Flax ``params`` into ``torch_module`` (strict: every key must match). ``stacked``:
    the Flax paths of ``nn.scan`` layer stacks ('layers'), split into ``layers.{i}``. Returns the module."""
    import torch

    sd = {k: torch.from_numpy(v.copy()) for k, v in params_to_state_dict(params, stacked=stacked).items()}
    torch_module.load_state_dict(sd, strict=True)
    return torch_module


def torch_params(torch_module, template: Mapping, stacked: Iterable[str] = ()) -> dict:
    """``torch_module``'s parameters as a Flax tree shaped like ``template`` (NumPy leaves, the
    template's dtypes); the inverse of ``load_into``."""
    return state_dict_to_params(dict(torch_module.named_parameters()), template, stacked=stacked)


def torch_grads(torch_module, template: Mapping, stacked: Iterable[str] = (), dtype=np.float32) -> dict:
    """The ``.grad`` of every parameter of ``torch_module`` (zeros where torch has none), arranged
    like the Flax ``template``, as ``dtype`` (np.float64 for a float64 reference: float32 would round it)."""
    import torch

    sd = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in torch_module.named_parameters()}
    template = jax.tree.map(lambda a: np.zeros(np.shape(a), dtype), template)
    return state_dict_to_params(sd, template, stacked=stacked)


def grads_into(torch_module, grads: Mapping, stacked: Iterable[str] = ()):
    """Set ``torch_module``'s parameter ``.grad`` from a Flax gradient tree (the inverse of
    ``torch_grads``; e.g. to step a torch optimizer with jaxgpt's gradients). Strict: the tree must
    name every parameter, and no other. Returns the module."""
    import torch

    sd = params_to_state_dict(grads, stacked=stacked)
    named = dict(torch_module.named_parameters())
    missing, unexpected = sorted(set(named) - set(sd)), sorted(set(sd) - set(named))
    if missing or unexpected:
        raise ValueError(f"gradient tree does not match the module: missing {missing}, unexpected {unexpected}")
    for key, p in named.items():
        if tuple(sd[key].shape) != tuple(p.shape):
            raise ValueError(f"gradient {key}: shape {tuple(sd[key].shape)}, parameter {tuple(p.shape)}")
        p.grad = torch.from_numpy(sd[key].copy()).to(p.dtype)
    return torch_module


__all__ = ["grads_into", "load_into", "random_params", "randomize", "set_seed_offset", "torch_grads", "torch_params"]
