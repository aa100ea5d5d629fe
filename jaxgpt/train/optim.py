"""AdamW as the seeds and torch configure it: decoupled weight decay on every parameter, on Linear
weights only, or on Linear weights and embeddings; warmup + cosine or constant learning rate,
global-norm clipping."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxgpt.config import TrainConfig


def schedule(tc: TrainConfig):
    """optax schedule (update count -> learning rate): ``TrainConfig.lr_at`` evaluated in jnp, the
    one copy of the formula (torch_ref.train's LambdaLR evaluates it on Python floats)."""
    if tc.schedule == "constant":
        return optax.constant_schedule(tc.lr)
    return functools.partial(tc.lr_at, xp=jnp)


# The Linear weights of every expert, stacked (E, in, out) in one parameter each (jaxgpt.nn.moe.Experts).
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def decay_mask(params, leaves: tuple[str, ...] = ("kernel", *EXPERT_WEIGHTS)):
    """True on the parameters named ``leaves``: Dense kernels and MoE expert weights ('linear'), plus
    embedding tables ('matrices', nanoGPT's choice). Norms, biases and AttnRes queries are never
    decayed. Keyed on names, not rank: scanned norm scales are (L, d). The torch mirror selects
    nn.Linear (and nn.Embedding) weights and the Experts' weights. ``params`` may also be an NNX State
    (``jaxgpt.nnx``, ``nnx.Optimizer``), whose paths end in each Variable's ``.value``: the name is the
    last dict key."""
    def name(path) -> str:
        return next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))

    return jax.tree_util.tree_map_with_path(lambda path, _: name(path) in leaves, params)


DECAY_MASKS = {"linear": decay_mask, "matrices": lambda p: decay_mask(p, ("kernel", *EXPERT_WEIGHTS, "embedding"))}


def float32_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on float32 copies of the gradients and params, so its state (both Adam moments)
    and the clipping norm are float32 when params are stored in bfloat16/float16. optax.adamw's
    ``mu_dtype`` covers the first moment only: the second follows the params' dtype, and a bfloat16
    nu of squared small gradients underflows. Updates come back float32; ``optax.apply_updates``
    rounds each to its param's dtype. With float32 params this is the identity, and the state tree is
    exactly ``inner``'s (checkpoints keep their layout)."""
    def up(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def update(updates, state, params=None):
        return inner.update(up(updates), state, None if params is None else up(params))

    return optax.GradientTransformation(lambda params: inner.init(up(params)), update)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """clip (torch's clip_grad_norm_) -> AdamW(b1, b2, eps, weight decay x lr) with the schedule,
    state in float32 whatever the params' dtype (``float32_state``)."""
    adamw = optax.adamw(schedule(tc), b1=tc.beta1, b2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay,
                        mask=DECAY_MASKS.get(tc.decay))
    if tc.grad_clip is None:
        return float32_state(adamw)
    return float32_state(optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw))
