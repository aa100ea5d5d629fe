"""``check_module``: a Flax module against its torch twin, forward and every gradient, in one call."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.testing.compare import TOL, located
from jaxgpt.testing.params import load_into, random_params, torch_grads
from jaxgpt.testing.reference import assert_as_accurate_as_torch, float64_module, float64_torch, to_float64


def check_module(component: str, jax_module, torch_module, inputs: Sequence, *, params=None, jax_kwargs=None,
                 torch_kwargs=None, select: Callable = lambda out: out, grad_inputs: bool = True, seed: int = 0,
                 tol: float = TOL, stacked: Iterable[str] = (), jit: bool = False, direct_grads: bool = True):
    """Forward, parameter gradients and input gradients of ``jax_module`` and its torch twin
    ``torch_module`` on the same weights and inputs. Returns the Flax params used.

    - weights: ``params``, or ``random_params(jax_module, *inputs, seed=seed)`` (unit-scale draws);
      copied into ``torch_module`` by the layout rule (``stacked``: its ``nn.scan`` stacks);
    - inputs: NumPy arrays (``None`` passed through) given positionally to both; keyword arguments
      per side (``jax_kwargs``, ``torch_kwargs``: torch tensors there); ``select`` picks the output
      array from what each side returns. The torch module runs in eval mode;
    - gradients: of sum(output x a fixed random cotangent), w.r.t. every parameter (leaf by named leaf)
      and every float input (``grad_inputs``);
    - references, with these margins (float32 compute; max abs; gradients per leaf / max(1, max|g|)):
      the twin in float32: forward within ``tol``, gradients too unless ``direct_grads=False`` (for
      deep models, whose float32-vs-float32 gradient error sits near 1e-5 through rounding alone); and
      the twin in float64 on the same weights: forward and every gradient within max(``tol``,
      ``K64`` x the twin's own float32 error) (``assert_as_accurate_as_torch``).

    ``jit``: compile the forward and the gradient once each (cheaper than eager dispatch when every
    call has new shapes). Rows reported (``jaxgpt.testing.add_listener``): '<component> forward',
    '<component> grad params', '<component> grad inputs', each also '... vs float64'. A failure raises
    AssertionError naming the component, the error, the tolerance and the leaf or input."""
    import torch

    jax_kwargs, torch_kwargs = jax_kwargs or {}, torch_kwargs or {}
    xs = [None if x is None else np.asarray(x) for x in inputs]
    if params is None:
        params = random_params(jax_module, *xs, seed=seed, **jax_kwargs)
    load_into(torch_module, params, stacked).eval().zero_grad(set_to_none=True)
    torch64 = float64_module(torch_module)

    def f(p, *a):
        return select(jax_module.apply({"params": p}, *a, **jax_kwargs))

    maybe_jit = jax.jit if jit else (lambda g: g)
    y = maybe_jit(f)(params, *xs)
    differentiable = [x is not None and grad_inputs and x.dtype.kind == "f" for x in xs]
    txs = [None if x is None else torch.tensor(x, requires_grad=d) for x, d in zip(xs, differentiable)]
    ty = select(torch_module(*txs, **torch_kwargs))
    cot = np.random.default_rng(seed + 1).standard_normal(np.shape(y)).astype(np.float32)  # (like the output)
    with float64_torch():
        txs64 = [None if x is None else to_float64(x).requires_grad_(d) if d else to_float64(torch.tensor(x))
                 for x, d in zip(xs, differentiable)]
        ty64 = select(torch64(*txs64, **{k: to_float64(v) for k, v in torch_kwargs.items()}))
        (ty64 * torch.from_numpy(cot).double()).sum().backward()
    assert ty64.dtype == torch.float64, f"{component}: the float64 reference returned {ty64.dtype}"
    assert_as_accurate_as_torch(y, ty, ty64, f"{component} forward", tol=tol)

    argnums = tuple(i + 1 for i, d in enumerate(differentiable) if d)
    grads = maybe_jit(jax.grad(lambda p, *a: jnp.sum(f(p, *a) * cot), argnums=(0,) + argnums))(params, *xs)
    (ty * torch.from_numpy(cot)).sum().backward()
    assert_as_accurate_as_torch(grads[0], torch_grads(torch_module, params, stacked),
                                torch_grads(torch64, params, stacked, np.float64), f"{component} grad params",
                                grads=True, direct=direct_grads, tol=tol)
    for gi, i in zip(grads[1:], argnums):
        with located(f"input {i - 1}"):
            assert_as_accurate_as_torch(gi, txs[i - 1].grad, txs64[i - 1].grad, f"{component} grad inputs",
                                        unit_scale=True, direct=direct_grads, tol=tol)
    return params


__all__ = ["check_module"]
