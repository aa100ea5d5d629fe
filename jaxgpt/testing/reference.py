"""The float64 reference: the torch twin run in float64 on the same weights and inputs.

Two float32 results of a multi-layer gradient can differ by ~1e-5 through rounding alone, by an amount
that depends on the CPU's kernels, so "jaxgpt float32 == torch float32 within 1e-5" cannot always be
asked. Against the twin in float64 it can be asked how accurate each float32 side is, and jaxgpt must be
as accurate as torch, up to a factor:

    error(jaxgpt float32 vs float64) <= max(tol, K64 x error(torch float32 vs float64))

torch is imported inside the functions that use it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator

import numpy as np

from jaxgpt.testing.compare import TOL, assert_close, assert_grads_close, emit, leaf_errors, record, scaled_err

# How much larger than torch's own float32 error (against float64) jaxgpt's may be, where it is above
# 1e-5. Over 20 weight draws of jaxgpt's model tests (docs/parity-margins.md) the median jaxgpt/torch_ref
# ratio is 0.6-1.2 per component, but each error is a worst element, so single ratios scatter (up to
# 5.7 on ill-conditioned Attention Residuals models); 8 leaves room for that and another CPU's kernels,
# while a wiring error (>= 1e-3) still fails by 20x.
K64 = 8.0


@dataclasses.dataclass(frozen=True)
class Float64Comparison:
    """One ``assert_as_accurate_as_torch`` judgement, as handed to the listeners: the errors of
    jaxgpt's and torch's float32 results against the float64 one, the direct float32-vs-float32 error,
    the ``bound`` jaxgpt was held to, ``k``, ``tol``, and whether the direct error was asserted."""

    component: str
    jaxgpt: float
    torch: float
    direct: float
    bound: float
    k: float
    tol: float
    direct_asserted: bool


@contextlib.contextmanager
def float64_torch() -> Iterator[None]:
    """torch in float64 for the ``with`` block: new tensors default to float64, and ``x.float()`` (an
    upcast for bfloat16 inputs, which would round a float64 tensor down to float32) leaves float64 alone.
    Both are restored afterwards, also after an error."""
    import torch

    upcast, default = torch.Tensor.float, torch.get_default_dtype()

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else upcast(self, *args, **kwargs)

    torch.Tensor.float = keep_float64
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.Tensor.float = upcast
        torch.set_default_dtype(default)


def _tensors(out):
    import torch

    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            yield from _tensors(getattr(out, f.name))


def float64_module(torch_module):
    """A float64 copy of ``torch_module``: the same (float32) weights, exactly, in float64, without
    gradients. Every submodule's floating outputs are checked to be float64 (an AssertionError names the
    submodule otherwise), so no float32 step inside makes the reference no better than float32. Run it
    inside ``float64_torch()``."""
    import torch

    module = copy.deepcopy(torch_module).double()
    module.zero_grad(set_to_none=True)

    def check(sub, args, out):
        bad = {str(t.dtype) for t in _tensors(out) if t.is_floating_point() and t.dtype != torch.float64}
        assert not bad, f"float64 reference: {type(sub).__name__} returned {bad}"

    for sub in module.modules():
        sub.register_forward_hook(check)
    return module


def to_float64(x):
    """A float input (torch tensor or NumPy array) as a float64 torch tensor; anything else unchanged."""
    import torch

    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double()
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return torch.from_numpy(x.astype(np.float64))
    return x


def _worst(errors: dict[str, float]) -> tuple[float, str]:
    return max(((e, k) for k, e in errors.items()), default=(0.0, ""))


def assert_as_accurate_as_torch(got, torch_got, exact, component: str, *, grads: bool = False,
                                unit_scale: bool = False, direct: bool = True, k: float = K64,
                                tol: float = TOL) -> float:
    """jaxgpt's float32 ``got`` against ``exact``, torch's result in float64 on the same weights and
    inputs: error <= max(tol, k x torch float32's own error, ``torch_got`` vs ``exact``).

    ``direct``: also jaxgpt vs torch float32 within ``tol`` (``assert_close`` / ``assert_grads_close``);
    False where that float32-vs-float32 error sits near ``tol`` through rounding alone. ``grads``: trees
    of gradients under the gradient rule (per leaf / max(1, max|ref leaf|); the worst leaf is judged and
    named); otherwise arrays, ``unit_scale`` as in ``assert_close``. Reported: a ``Float64Comparison``,
    then '<component>' (the direct check) and '<component> vs float64'. Returns jaxgpt's error."""
    if grads:
        (jerr, leaf), (terr, _), (derr, _) = (_worst(leaf_errors(a, b)) for a, b in
                                              ((got, exact), (torch_got, exact), (got, torch_got)))
    else:
        jerr, terr, derr = (scaled_err(a, b, unit_scale) for a, b in ((got, exact), (torch_got, exact), (got, torch_got)))
        leaf = ""
    bound = max(tol, k * terr)
    emit(Float64Comparison(component, jerr, terr, derr, bound, k, tol, direct))
    if direct:
        if grads:
            assert_grads_close(got, torch_got, component, tol)
        else:
            assert_close(got, torch_got, component, tol, unit_scale=unit_scale)
    record(f"{component} vs float64", jerr, tol=bound)
    where = f" [leaf {leaf}]" if leaf else ""
    assert jerr <= bound, (f"{component}: jaxgpt float32 vs float64 reference {jerr:.3e} > max({tol:.0e}, {k:g} x "
                           f"torch float32's {terr:.3e}){where}")
    return jerr


__all__ = ["K64", "Float64Comparison", "assert_as_accurate_as_torch", "float64_module", "float64_torch", "to_float64"]
