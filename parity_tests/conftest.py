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
environment variable CI is true (so CI cannot pass by skipping every seed comparison). Optional
packages the tests need (transformers, tokenizers, ...) go through ``require_module``, the same
rule. The only skip CI accepts is a missing accelerator.

The float64 reference (``check_module``, ``assert_as_accurate_as_torch``): two float32 results
of a multi-layer gradient can differ by ~1e-5 through rounding alone, and by how much depends on
the CPU's kernels. So the models' gradients are judged against torch_ref run in float64 on the
same weights and inputs: jaxgpt's float32 error must be <= max(1e-5, K64 x torch_ref float32's
own error against that float64 result). The measured margins are in docs/parity-margins.md
(``make parity-margins`` regenerates it: JAXGPT_PARITY_MARGINS=<file>).

Speed: JAX's persistent compilation cache is on in the pytest processes (.pytest_cache/jax-cache,
every program cached); the suite runs under pytest-xdist (``make test``), and the tables above
are merged from the workers. XLA:CPU compiles the tests' programs with LLVM at -O0 and without
its expensive passes (``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes``):
the suite is mostly compilation (in test_train.py's loss curves, 27 of 48 s compiling, 10 tracing),
a test checks numbers and behaviour, not speed, and neither setting changes IEEE float semantics
(no fast-math). -O0 cut a cold run of test_attnres.py + test_train.py from 125 to 92 s, the second
flag test_train.py's loss curves from 46-51 to 37-41 s (2026-11-27, one process, A B A B).
With jaxlib 0.10 they also use XLA:CPU's older fusion emitters (``--xla_cpu_use_fusion_emitters=false``):
test_train.py + test_attention.py cold 152/148 -> 95/98 s, the fast tier cold 514 -> 320 s (2026-11-27).
Tests marked ``same_bits`` (two different programs, equal bit for bit as XLA compiles by default) then run
in a fresh pytest process with the default emitters; JAXGPT_TEST_FUSION_EMITTERS=default turns the flag off.
JAXGPT_TEST_XLA_OPT=default compiles as users do (``make parity-margins`` and ``make test-gpu`` do);
so do the fresh-interpreter checks of the device-count flags.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

# The compile flags of every test process: this one (set before JAX starts, see the docstring), the commands it
# runs (inherited), and the workers that set XLA_FLAGS themselves (sharding, multi-host: ``xla_flags``).
TEST_XLA_FLAGS = "" if os.environ.get("JAXGPT_TEST_XLA_OPT", "0") == "default" else (
    f"--xla_backend_optimization_level={os.environ.get('JAXGPT_TEST_XLA_OPT', '0')} "
    "--xla_llvm_disable_expensive_passes=true")
# XLA:CPU's older fusion emitters compile about a third faster than its MLIR ones (the docstring). An XLA that does
# not know the flag aborts the process, so it is set only for the jaxlib it was verified with.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if (TEST_XLA_FLAGS and os.environ.get("JAXGPT_TEST_FUSION_EMITTERS") != "default"
        and importlib.metadata.version("jaxlib").startswith("0.10.")):
    TEST_XLA_FLAGS += f" {LEGACY_EMITTERS}"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once, if imported again as parity_tests.conftest
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# One CPU device per core, as the jaxgpt command and fit give a user: the sharded and multi-device tests use them
from jaxgpt import use_host_devices  # noqa: E402 - after the setup above, which must run first

use_host_devices()

import jax  # noqa: E402 - after the setup above, which must run first
import jax.numpy as jnp  # noqa: E402 - after the setup above, which must run first
import numpy as np  # noqa: E402 - after the setup above, which must run first
import pytest  # noqa: E402 - after the setup above, which must run first


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a worker process that picks its own (a device count): the tests' compile flags too."""
    return " ".join((TEST_XLA_FLAGS, *flags)).strip()


# No JAX-wide matmul precision: on a GPU, float32 parity at 1e-5 is the library's own policy
# (ModelConfig.matmul_precision='auto': full float32 for float32 compute; jaxgpt/nn/precision.py).
# Tests marked cpu_only hold only on the CPU backend (its C++ kernels, no cuDNN): skipped elsewhere.


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "cpu":
        return
    skip = pytest.mark.skip(reason=f"{ACCELERATOR_SKIP} cpu_only: holds on the CPU backend only "
                                   f"(this run: {jax.default_backend()})")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


# Persistent compilation cache (a second run loads the compiled programs instead of compiling them),
# with the commands' settings (jaxgpt.cli.compile_cache): every program cached, however fast it
# compiled, and no size cap (with one, JAX locks and scans the folder on every write, which made a cold
# `make test` 1.9x slower: 1464 s against 787 s with the cache off).
# Unlocked, two xdist workers may race on one entry; JAX then warns and compiles instead (a read
# error is never fatal). JAXGPT_TEST_JAX_CACHE=off turns it off. Only this process uses it: the
# subprocesses the tests start do not (JAX writes an entry in place, so a test that SIGKILLs a run
# could leave a truncated one behind).
from jaxgpt.cli import compile_cache  # noqa: E402 - after the setup above, which must run first

compile_cache.enable(os.environ.get("JAXGPT_TEST_JAX_CACHE",
                                    str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-cache")))
# ...and the commands the tests start keep out of the user's cache (jaxgpt.cli.compile_cache)
os.environ["JAXGPT_COMPILE_CACHE"] = "off"
# Kernel choices do not depend on a timing taken while other tests load the cores: every kernel runs
# where it can (jaxgpt/nn/kernels/calibrate.py; test_calibrate.py tests the measured choice itself)
os.environ.setdefault("JAXGPT_CALIBRATION", "off")

import torch  # noqa: E402 - after the setup above, which must run first

from jaxgpt.core.layout import params_to_state_dict, state_dict_to_params  # noqa: E402 - after the setup above, which must run first

torch.set_default_dtype(torch.float32)
TOL = 1e-5  # float32 forward and gradient tolerance, max abs on unit-scale tensors
from scripts.harness import SHARED  # noqa: E402  (the one rule for ../shared: $JAXGPT_SHARED, beside the clone)
KINDS = {"parity": "parity: worst max-abs error vs an independent reference, per component",
         "self": "self-consistency: worst max-abs error of an implementation vs itself, per check"}
WORST: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in KINDS}
TOLS: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}  # shown where a row's bound is not TOL


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# The one skip CI accepts: a test that needs an accelerator it does not have, or the CPU backend it
# is not on. Every such skip reason starts with this; under CI=true any other skip (no C++ compiler
# for the CPU kernels, one host device, ...) is reported as a failure, since it would hide one.
ACCELERATOR_SKIP = "accelerator:"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``same_bits`` test compares two different programs bit for bit (a loop of steps against one-step calls),
    which holds as XLA compiles by default, not with the tests' legacy fusion emitters: it runs in a fresh
    pytest process compiled with XLA's own emitters, and passes or fails with it."""
    if not (pyfuncitem.get_closest_marker("same_bits") and LEGACY_EMITTERS in TEST_XLA_FLAGS):
        return None
    import sys

    env = dict(os.environ, JAXGPT_TEST_FUSION_EMITTERS="default",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(LEGACY_EMITTERS, "").strip())
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid}, run with XLA's default fusion emitters, failed:\n{r.stdout[-6000:]}"
                    f"{r.stderr[-2000:]}", pytrace=False)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and on_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(ACCELERATOR_SKIP):
            report.outcome = "failed"
            report.longrepr = (f"CI=true: a skip hides a failure here; only '{ACCELERATOR_SKIP} ...' skips are "
                               f"accepted (parity_tests/conftest.py). The skip: {reason}")


def require_shared(path: Path, what: str = "reference") -> Path:
    """``path`` (under ../shared) if it exists; otherwise skip the test, or fail it under CI=true."""
    path = Path(path)
    if not path.exists():
        msg = f"{what} {path} is missing (the shared folder beside the clone, {SHARED}, is not there or incomplete)"
        if on_ci():
            pytest.fail(msg + "; CI=true, so a missing reference is an error, not a skip", pytrace=False)
        pytest.skip(msg)
    return path


def require_module(name: str, allow_module_level: bool = False):
    """``import name`` (an optional dependency of the tests, in the ``test`` extra); if it is not
    installed, skip the test (or, with ``allow_module_level``, the whole file) locally, and fail it
    under CI=true, where every test dependency is installed and a skip would hide a failure."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        msg = f"{name} is not installed ({e}); pip install -e '.[test]'"
        if on_ci():
            pytest.fail(msg + "; CI=true, so a missing test dependency is an error, not a skip", pytrace=False)
        pytest.skip(msg, allow_module_level=allow_module_level)


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


# JAXGPT_PARITY_SEED_OFFSET=s: every randomize()d weight drawn from seed + s (0: the suite as committed);
# for measuring the float64 margins at other weights (docs/parity-margins.md), not for CI.
SEED_OFFSET = int(os.environ.get("JAXGPT_PARITY_SEED_OFFSET", "0"))


def randomize(params, seed: int = 0):
    """Unit-scale weights: kernels N(0, 1/fan_in), embeddings N(0, 1/d), the rest N(0, 1/4) around its init
    (so norm scales are not all ones and biases not all zeros: bugs in either show up)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed + SEED_OFFSET)
    out = []
    for path, leaf in leaves:
        name = getattr(path[-1], "key", "")
        shape = np.shape(leaf)
        if name in ("kernel", "gate_proj", "up_proj", "down_proj"):  # Dense kernels, MoE experts (E, in, out)
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


def torch_grads(torch_module, template, stacked=(), dtype=np.float32):
    """Gradients of the torch module's parameters, arranged like the Flax params, as ``dtype``
    (np.float64 for a float64 reference: the template's float32 would round them)."""
    sd = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in torch_module.named_parameters()}
    template = jax.tree.map(lambda a: np.zeros(np.shape(a), dtype), template)
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


# The float64 reference -----------------------------------------------------------------------------
# K64: how much larger than torch_ref's own float32 error (against float64) jaxgpt's may be, where it
# is above 1e-5. Measured over 20 weight draws of the model tests (docs/parity-margins.md): the
# median jaxgpt/torch_ref ratio is 0.6-1.2 per component (jaxgpt is as accurate as torch), but each
# error is a worst element, so single ratios scatter: up to 5.7 on the ill-conditioned AttnRes models
# (random pseudo-queries, sharp depth softmaxes), under 2 elsewhere. 8 leaves room for that scatter
# and another CPU's kernels; at the suite's own weights every bound is <= 5.2e-5, so a wiring error
# (>= 1e-3) still fails by 20x.
K64 = 8.0
MARGINS: dict[str, dict[str, float]] = {}  # component -> worst direct / jaxgpt / torch error, ratio, bound


@contextlib.contextmanager
def float64_torch():
    """torch in float64: new tensors default to float64, and torch_ref's ``x.float()`` (its upcast
    for bfloat16 inputs, which would round a float64 tensor down to float32) leaves float64 alone."""
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
    gradients. Every submodule's floating outputs are checked to be float64, so no float32 step
    inside makes the reference no better than float32. Run it inside ``float64_torch()``."""
    module = copy.deepcopy(torch_module).double()
    module.zero_grad(set_to_none=True)

    def check(sub, args, out):
        bad = {str(t.dtype) for t in _tensors(out) if t.is_floating_point() and t.dtype != torch.float64}
        assert not bad, f"float64 reference: {type(sub).__name__} returned {bad}"

    for sub in module.modules():
        sub.register_forward_hook(check)
    return module


def to_float64(x):
    """A float input as a float64 tensor (others unchanged), for the float64 reference."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double()
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return torch.from_numpy(x.astype(np.float64))
    return x


def _scaled_err(a, ref, unit_scale: bool) -> float:
    err = max_err(a, ref)
    if unit_scale and np.size(to_np(ref)):
        err /= max(1.0, float(np.max(np.abs(to_np(ref)))))
    return err


def assert_as_accurate_as_torch(got, torch_got, exact, component: str, *, grads: bool = False,
                                unit_scale: bool = False, direct: bool = True, k: float = K64,
                                tol: float = TOL) -> float:
    """jaxgpt's float32 ``got`` against ``exact``, torch_ref's result in float64 on the same weights and
    inputs: error <= max(tol, k x torch_ref float32's own error, ``torch_got`` vs ``exact``).
    ``direct``: also jaxgpt vs torch_ref float32 within ``tol`` (assert_close / assert_grads_close);
    False where that float32-vs-float32 error sits near ``tol`` through rounding alone (recorded in
    the margins table either way). ``grads``: trees of gradients under the gradient rule (per leaf
    / max(1, max|ref leaf|), worst leaf); otherwise arrays, ``unit_scale`` as in assert_close.
    Parity table rows: '<component>' (direct) and '<component> vs float64'; margins table
    (docs/parity-margins.md): the errors, the ratio and how far below its bound each stayed.
    Returns jaxgpt's error against float64."""
    err = grads_err if grads else (lambda a, b: _scaled_err(a, b, unit_scale))
    jerr, terr, derr = err(got, exact), err(torch_got, exact), err(got, torch_got)
    bound = max(tol, k * terr)
    m = MARGINS.setdefault(component, dict(direct=0.0, jaxgpt=0.0, torch=0.0, ratio=0.0, ratios=[],
                                           headroom=np.inf, direct_headroom=np.inf if direct else 0.0, k=k))
    m.update(direct=max(m["direct"], derr), jaxgpt=max(m["jaxgpt"], jerr), torch=max(m["torch"], terr),
             ratio=max(m["ratio"], jerr / max(terr, 1e-30) if jerr > tol else 0.0),
             ratios=m["ratios"] + [jerr / max(terr, 1e-30)],
             headroom=min(m["headroom"], bound / max(jerr, 1e-30)))
    if direct:
        m["direct_headroom"] = min(m["direct_headroom"], tol / max(derr, 1e-30))
        if grads:
            assert_grads_close(got, torch_got, component, tol)
        else:
            assert_close(got, torch_got, component, tol, unit_scale=unit_scale)
    record(f"{component} vs float64", jerr, tol=bound)
    assert jerr <= bound, (f"{component}: jaxgpt float32 vs float64 reference {jerr:.3e} > max({tol:.0e}, {k:g} x "
                           f"torch_ref float32's {terr:.3e})")
    return jerr


def random_params(module, *inputs, seed: int = 0, **kwargs):
    """``randomize``d params for ``module.init(key, *inputs, **kwargs)``, without running the init:
    only its shapes are traced (jax.eval_shape), so no op is compiled or executed."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs, **kwargs))["params"]
    return randomize(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), seed)


def check_module(component, jax_module, torch_module, inputs, *, params=None, jax_kwargs=None,
                 torch_kwargs=None, select=lambda out: out, grad_inputs=True, seed=0, tol=TOL, stacked=(),
                 jit=False, direct_grads=True):
    """Forward and gradients (w.r.t. float inputs and every parameter) of a Flax module and its
    torch mirror, on the same randomized weights. ``select`` picks the output array from what
    the module returns; ``None`` inputs are passed through as None. The torch module runs in eval
    mode (dropout is tested on its own). ``jit``: compile the forward and the gradient once each
    (cheaper than eager op-by-op dispatch when every call has new shapes, as in
    test_properties.py). Returns the Flax params used.

    Two references: torch_ref in float32 (forward within ``tol``; gradients too unless
    ``direct_grads=False``) and torch_ref in float64 on the same weights and inputs (forward and
    every gradient within max(``tol``, K64 x torch_ref float32's own error):
    ``assert_as_accurate_as_torch``). ``direct_grads=False`` is for the multi-layer models, whose
    float32-vs-float32 gradient error sits near 1e-5 and depends on the CPU's kernels."""
    jax_kwargs, torch_kwargs = jax_kwargs or {}, torch_kwargs or {}
    xs = [None if x is None else np.asarray(x) for x in inputs]
    if params is None:
        params = random_params(jax_module, *xs, seed=seed, **jax_kwargs)
    load_into(torch_module, params, stacked).eval()
    torch64 = float64_module(torch_module)

    def f(p, *a):
        return select(jax_module.apply({"params": p}, *a, **jax_kwargs))

    maybe_jit = jax.jit if jit else (lambda g: g)
    y = maybe_jit(f)(params, *xs)
    differentiable = [x is not None and grad_inputs and x.dtype.kind == "f" for x in xs]
    txs = [None if x is None else torch.tensor(x, requires_grad=d) for x, d in zip(xs, differentiable)]
    ty = select(torch_module(*txs, **torch_kwargs))
    cot = np.random.default_rng(seed + 1).standard_normal(np.shape(y)).astype(np.float32)
    with float64_torch():
        txs64 = [None if x is None else to_float64(x).requires_grad_(d) if d else to_float64(torch.tensor(x))
                 for x, d in zip(xs, differentiable)]
        ty64 = select(torch64(*txs64, **{k: to_float64(v) for k, v in torch_kwargs.items()}))
        (ty64 * torch.from_numpy(cot).double()).sum().backward()
    assert ty64.dtype == torch.float64
    assert_as_accurate_as_torch(y, ty, ty64, f"{component} forward", tol=tol)

    argnums = tuple(i + 1 for i, d in enumerate(differentiable) if d)
    grads = maybe_jit(jax.grad(lambda p, *a: jnp.sum(f(p, *a) * cot), argnums=(0,) + argnums))(params, *xs)
    (ty * torch.from_numpy(cot)).sum().backward()
    assert_as_accurate_as_torch(grads[0], torch_grads(torch_module, params, stacked),
                                torch_grads(torch64, params, stacked, np.float64), f"{component} grad params",
                                grads=True, direct=direct_grads, tol=tol)
    for gi, i in zip(grads[1:], argnums):
        assert_as_accurate_as_torch(gi, txs[i - 1].grad, txs64[i - 1].grad, f"{component} grad inputs",
                                    unit_scale=True, direct=direct_grads, tol=tol)
    return params


def _tables() -> dict:
    return {"worst": {k: dict(v) for k, v in WORST.items()}, "tols": TOLS, "margins": MARGINS}


def _merge(tables: dict) -> None:
    """Fold another process's tables (an xdist worker's; an earlier seed's margins) into this one's."""
    for kind, rows in tables.get("worst", {}).items():
        for k, v in rows.items():
            WORST[kind][k] = max(WORST[kind][k], v)
    for kind, rows in tables.get("tols", {}).items():
        for k, v in rows.items():
            TOLS[kind][k] = max(TOLS[kind].get(k, v), v)
    for k, m in tables.get("margins", {}).items():
        if k not in MARGINS:
            MARGINS[k] = dict(m)
            continue
        old = MARGINS[k]
        old.update({c: max(old[c], m[c]) for c in ("direct", "jaxgpt", "torch", "ratio")},
                   ratios=old["ratios"] + m["ratios"], **{c: min(old[c], m[c]) for c in ("headroom", "direct_headroom")})


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the tables to the controller
        session.config.workeroutput["jaxgpt_tables"] = json.dumps(_tables())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", None) or {}
    if "jaxgpt_tables" in out:
        _merge(json.loads(out["jaxgpt_tables"]))


def machine() -> str:
    """The CPU (lscpu's model name, cores) and the library versions, for the margins file."""
    cpu = platform.processor() or platform.machine()
    try:
        info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                 check=True).stdout.splitlines() if ":" in line)
        flags = set(info.get("Flags", "").split())
        simd = next((f for f in ("avx512f", "avx2", "avx", "neon", "asimd") if f in flags), "")
        cpu = (f"{info['Model name'].strip()}, {info.get('Vendor ID', '?').strip()} family "
               f"{info.get('CPU family', '?').strip()} model {info.get('Model', '?').strip()}"
               f"{', ' + simd if simd else ''} ({info['CPU(s)'].strip()} CPUs, {info['Architecture'].strip()}"
               f"{', ' + info['Hypervisor vendor'].strip() + ' VM' if 'Hypervisor vendor' in info else ''})")
    except (OSError, subprocess.CalledProcessError, KeyError):
        pass
    return (f"{cpu}; jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
            f"numpy {np.__version__}, Python {platform.python_version()}")


def margins_markdown() -> str:
    rows = ["| component | n | jaxgpt f32 vs f64 | torch_ref f32 vs f64 | ratio: median | ratio: worst over 1e-5 | "
            "bound / jaxgpt err | jaxgpt vs torch_ref f32 | 1e-5 / that |", "|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(MARGINS):
        m = MARGINS[k]
        ratio = f"{m['ratio']:.2f}" if m["ratio"] else "-"
        direct = ("not asserted" if not m["direct_headroom"] else "equal" if not m["direct"]
                  else f"{m['direct_headroom']:.1f}")
        rows.append(f"| {k} | {len(m['ratios'])} | {m['jaxgpt']:.2e} | {m['torch']:.2e} | "
                    f"{float(np.median(m['ratios'])):.2f} | {ratio} | {m['headroom']:.1f} | {m['direct']:.2e} | {direct} |")
    return "\n".join(rows)


def write_margins(path: Path) -> None:
    """docs/parity-margins.md. With JAXGPT_PARITY_MARGINS_MERGE=<json>, the rows of earlier runs
    (other JAXGPT_PARITY_SEED_OFFSET values) kept there are merged in first, and the result kept there."""
    seeds = [SEED_OFFSET]
    keep = os.environ.get("JAXGPT_PARITY_MARGINS_MERGE")
    if keep:
        if Path(keep).exists():
            earlier = json.loads(Path(keep).read_text())
            _merge({"margins": earlier["margins"]})
            seeds = sorted(set(earlier["seeds"]) | set(seeds))
        Path(keep).write_text(json.dumps({"margins": MARGINS, "seeds": seeds}))
    over = [(m["ratio"], k) for k, m in MARGINS.items() if m["ratio"]]
    medians = [float(np.median(m["ratios"])) for m in MARGINS.values()]
    worst = (f"the median jaxgpt/torch_ref ratio per component is {min(medians):.2f} to {max(medians):.2f} "
             "(jaxgpt is as accurate as torch_ref), and " + ("none of jaxgpt's errors exceeded 1e-5" if not over else
             "the worst single ratio where jaxgpt's error exceeded 1e-5 is {:.2f} ({})".format(*max(over))))
    listed = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)) \
        else ", ".join(map(str, seeds))
    path.write_text(MARGINS_HEADER.format(machine=machine(), k=K64, tol=TOL, worst=worst, n=len(seeds), seeds=listed)
                    + margins_markdown() + "\n")


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if hasattr(tr.config, "workerinput"):
        return  # an xdist worker: its tables go to the controller (pytest_sessionfinish), which prints them
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
    margins = os.environ.get("JAXGPT_PARITY_MARGINS")
    if margins and MARGINS:
        write_margins(Path(margins))
        tr.write_line(f"float64 margins written to {margins}")


MARGINS_HEADER = """# Parity margins against a float64 reference

Generated by `make parity-margins MARGIN_SEEDS="$(seq 0 19)"`: the float64-referenced parity tests
(`-k torch_ref` in the files listed in the Makefile) with JAXGPT_PARITY_MARGINS set, once per draw
of the random weights (JAXGPT_PARITY_SEED_OFFSET; the suite itself runs offset 0), here {n} draw(s):
offsets {seeds}. parity_tests/conftest.py writes this file. Measured on: {machine}.

Why: two float32 computations of a multi-layer gradient differ by ~1e-5 through rounding alone,
by an amount that depends on the CPU's kernels (issue #18: on a 2-core AMD EPYC, jaxgpt vs
torch_ref on the EncDec seed-like gradients measured 1.003e-05 > 1e-05). So each float32 side is
also compared with torch_ref run in float64 on the same weights and inputs (torch.float64; torch_ref's
`.float()` upcasts are kept from rounding it back to float32, and every submodule is checked to
return float64), and jaxgpt must satisfy

    error(jaxgpt float32 vs float64) <= max({tol:.0e}, K64 x error(torch_ref float32 vs float64)),  K64 = {k:g}

Errors are max abs; outputs as their test states (unit scale, or / max(1, max|ref|)); gradients per
leaf / max(1, max|g_ref|), worst leaf. A row gathers the comparisons under one name (parametrisations
and weight draws). Columns: n, the number of comparisons; jaxgpt's and torch_ref's float32 errors
against float64 (worst); the jaxgpt/torch_ref error ratio, its median and its worst among the
comparisons where jaxgpt's error exceeded 1e-5 (the only ones where K64 matters; "-": none did); the
smallest bound / jaxgpt error (the margin: >= 1 passes); the direct float32-vs-float32 error (worst)
and, where that comparison is asserted at 1e-5 too, its smallest margin 1e-5 / error ("not
asserted": at some draw it came within 2x of 1e-5 through rounding alone, so only the float64 bound
is asserted; "equal": bit-identical).

Over these draws {worst}.

"""


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
