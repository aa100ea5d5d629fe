"""Shared harness for the parity suite: float32 everywhere, full-precision matmuls, the same
weights on both sides (copied through the converter), and two tables printed at the end of the
run (and written to $JAXGPT_PARITY_REPORT as {"parity": {...}, "self": {...}} if set):

- parity: the worst error per component of jaxgpt (or torch_ref) against a reference it did not
  compute itself (torch_ref, torch built-ins, Hugging Face, the seeds' code): ``assert_close``;
- self-consistency: the worst error of one implementation against itself (KV cache vs full
  recompute, jit vs eager, scan vs unrolled, round trips): ``assert_self_consistent``.

One tolerance rule: float32 forward 1e-5 max abs; gradients (``assert_grads_close``, and the
gradients in ``check_module``) 1e-5 max abs after dividing by max(1, max|g_ref|) per leaf.

References that live outside the repository (../shared: seed texts, Tiny Shakespeare) are
reached through ``require_shared``: a missing one skips the test locally, and fails it when the
environment variable CI is true (so CI cannot pass by skipping every seed comparison).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPU runs

import torch  # noqa: E402

from jaxgpt.core.layout import params_to_state_dict, state_dict_to_params  # noqa: E402

torch.set_default_dtype(torch.float32)
TOL = 1e-5  # float32 forward and gradient tolerance, max abs on unit-scale tensors
SHARED = Path(__file__).resolve().parents[2] / "shared"
KINDS = {"parity": "parity: worst max-abs error vs an independent reference, per component",
         "self": "self-consistency: worst max-abs error of an implementation vs itself, per check"}
WORST: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in KINDS}
TOLS: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}  # shown where a row's bound is not TOL


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_shared(path: Path, what: str = "reference") -> Path:
    """``path`` (under ../shared) if it exists; otherwise skip the test, or fail it under CI=true."""
    path = Path(path)
    if not path.exists():
        msg = f"{what} {path} is missing (the shared folder beside the clone, {SHARED}, is not there or incomplete)"
        if on_ci():
            pytest.fail(msg + "; CI=true, so a missing reference is an error, not a skip", pytrace=False)
        pytest.skip(msg)
    return path


def record(component: str, err: float, kind: str = "parity", tol: float = TOL) -> float:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    WORST[kind][component] = max(WORST[kind][component], float(err))
    TOLS[kind][component] = max(TOLS[kind].get(component, tol), tol)
    return float(err)


def max_err(a, b) -> float:
    a, b = np.asarray(to_np(a), np.float64), np.asarray(to_np(b), np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def assert_close(a, b, component: str, tol: float = TOL, unit_scale: bool = False, kind: str = "parity") -> float:
    """max |a - b| <= tol, with ``b`` the reference; recorded under ``component`` in the ``kind``
    table ('parity': ``b`` is an independent reference; 'self': the same code another way).

    unit_scale: divide the error by max(1, max |b|) first. Gradients summed over a batch are
    not unit-scale tensors (a norm's scale gradient reaches ~60 in these tests), so they are
    brought to unit scale before the 1e-5 bound applies; unit-scale tensors are unchanged.
    """
    err = max_err(a, b)
    if unit_scale:
        err /= max(1.0, float(np.max(np.abs(to_np(b)))) if np.size(to_np(b)) else 1.0)
    err = record(component, err, kind, tol)
    assert err <= tol, f"{component}: max abs error {err:.3e} > {tol:.2g}"
    return err


def assert_self_consistent(a, b, component: str, tol: float = TOL, unit_scale: bool = False) -> float:
    """assert_close for a self-consistency check (cache vs none, jit vs eager, ...): own table."""
    return assert_close(a, b, component, tol, unit_scale, kind="self")


def to_np(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def randomize(params, seed: int = 0):
    """Unit-scale weights: kernels N(0, 1/fan_in), embeddings N(0, 1/d), the rest N(0, 1/4) around its init
    (so norm scales are not all ones and biases not all zeros: bugs in either show up)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = getattr(path[-1], "key", "")
        shape = np.shape(leaf)
        if name == "kernel":
            v = rng.standard_normal(shape) / np.sqrt(shape[-2])
        elif name == "embedding":  # also a tied output head: keep its logits unit-scale
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif name == "scale":
            v = 1.0 + 0.5 * rng.standard_normal(shape)
        else:
            v = 0.5 * rng.standard_normal(shape)
        out.append(jnp.asarray(v, jnp.float32))
    return jax.tree_util.tree_unflatten(tree, out)


def load_into(torch_module, params, stacked=()):
    sd = {k: torch.from_numpy(v.copy()) for k, v in params_to_state_dict(params, stacked=stacked).items()}
    torch_module.load_state_dict(sd, strict=True)
    return torch_module


def torch_grads(torch_module, template, stacked=()):
    """Gradients of the torch module's parameters, arranged like the Flax params."""
    sd = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in torch_module.named_parameters()}
    return state_dict_to_params(sd, template, stacked=stacked)


def grads_err(tree, ref_tree) -> float:
    """The worst per-leaf max|g - g_ref| / max(1, max|g_ref|) (the gradient rule, not recorded)."""
    return max((max_err(leaf, _at(ref_tree, path)) / max(1.0, float(np.max(np.abs(to_np(_at(ref_tree, path))))))
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if np.size(leaf)), default=0.0)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def assert_grads_close(tree, ref_tree, component: str, tol: float = TOL, kind: str = "parity") -> float:
    """The one gradient rule: every leaf of ``tree`` against the leaf at the same path of
    ``ref_tree``, error / max(1, max|ref leaf|) <= tol. Returns the worst normalised error."""
    worst = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        worst = max(worst, assert_close(leaf, _at(ref_tree, path), component, tol, unit_scale=True, kind=kind))
    return worst


assert_trees_close = assert_grads_close  # the older name: every tree compared here is a gradient


def random_params(module, *inputs, seed: int = 0, **kwargs):
    """``randomize``d params for ``module.init(key, *inputs, **kwargs)``, without running the init:
    only its shapes are traced (jax.eval_shape), so no op is compiled or executed."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs, **kwargs))["params"]
    return randomize(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), seed)


def check_module(component, jax_module, torch_module, inputs, *, params=None, jax_kwargs=None,
                 torch_kwargs=None, select=lambda out: out, grad_inputs=True, seed=0, tol=TOL, stacked=(),
                 jit=False):
    """Forward and gradients (w.r.t. float inputs and every parameter) of a Flax module and its
    torch mirror, on the same randomized weights. ``select`` picks the output array from what
    the module returns; ``None`` inputs are passed through as None. The torch module runs in eval
    mode (dropout is tested on its own). ``jit``: compile the forward and the gradient once each
    (cheaper than eager op-by-op dispatch when every call has new shapes, as in
    test_properties.py). Returns the Flax params used."""
    jax_kwargs, torch_kwargs = jax_kwargs or {}, torch_kwargs or {}
    xs = [None if x is None else np.asarray(x) for x in inputs]
    if params is None:
        params = random_params(jax_module, *xs, seed=seed, **jax_kwargs)
    load_into(torch_module, params, stacked).eval()

    def f(p, *a):
        return select(jax_module.apply({"params": p}, *a, **jax_kwargs))

    maybe_jit = jax.jit if jit else (lambda g: g)
    y = maybe_jit(f)(params, *xs)
    differentiable = [x is not None and grad_inputs and x.dtype.kind == "f" for x in xs]
    txs = [None if x is None else torch.tensor(x, requires_grad=d) for x, d in zip(xs, differentiable)]
    ty = select(torch_module(*txs, **torch_kwargs))
    assert_close(y, ty, f"{component} forward", tol)

    cot = np.random.default_rng(seed + 1).standard_normal(np.shape(y)).astype(np.float32)
    argnums = tuple(i + 1 for i, d in enumerate(differentiable) if d)
    grads = maybe_jit(jax.grad(lambda p, *a: jnp.sum(f(p, *a) * cot), argnums=(0,) + argnums))(params, *xs)
    (ty * torch.from_numpy(cot)).sum().backward()
    assert_grads_close(grads[0], torch_grads(torch_module, params, stacked), f"{component} grad params", tol)
    for gi, i in zip(grads[1:], argnums):
        assert_close(gi, txs[i - 1].grad, f"{component} grad inputs", tol, unit_scale=True)
    return params


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    for kind, title in KINDS.items():
        rows = WORST[kind]
        if rows:
            tr.section(f"{title} (float32, tolerance {TOL:.0e} unless stated; grads / max(1, max|g|))")
            width = max(len(k) for k in rows)
            for k in sorted(rows):
                bound = TOLS[kind].get(k, TOL)
                tr.write_line(f"{k:<{width}}  {rows[k]:.2e}" + (f"  (tolerance {bound:.1e})" if bound != TOL else ""))
    report = os.environ.get("JAXGPT_PARITY_REPORT")
    if report and any(WORST.values()):
        Path(report).write_text(json.dumps({k: dict(sorted(v.items())) for k, v in WORST.items()}, indent=2) + "\n")


def seed_classes(filename: str, names: list[str]) -> dict:
    """Execute the named top-level classes/functions of a seed document (read from ../shared at
    test time, never copied into the repo) and return its namespace. Skips if it is missing
    (fails under CI=true: ``require_shared``)."""
    import math
    import re

    import torch.nn.functional as F

    path = require_shared(SHARED / "seeds" / filename, "seed file")
    text = path.read_text(encoding="utf-8")
    from dataclasses import dataclass
    from typing import Optional, Tuple

    ns = {"torch": torch, "nn": torch.nn, "F": F, "math": math, "np": np, "dataclass": dataclass,
          "Optional": Optional, "Tuple": Tuple, "Tensor": torch.Tensor}
    for name in names:
        starts = [m.start() for m in re.finditer(rf"^(?:@\w+\n)*(class|def) {name}\b", text, re.M)]
        assert starts, f"{name} not found in {filename}"
        lines = text[starts[-1]:].splitlines()
        n = 1
        while n < len(lines) and (not lines[n].strip() or lines[n][0] in " \t" or lines[n - 1].startswith("@")):
            n += 1  # the next unindented line ends the definition
        exec("\n".join(lines[:n]), ns)
    return ns


@pytest.fixture
def rng():
    return np.random.default_rng(0)
