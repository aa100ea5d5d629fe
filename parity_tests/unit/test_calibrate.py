"""Per-machine kernel choices (jaxgpt/nn/kernels/calibrate.py): measured once, stored on disk by
machine, instruction sets and versions, read back later; off, they leave every kernel on. And the
matvec kernel's rule (matvec_ffi.wins) following the stored answer into generate()'s program.

A measurement's figures are checked against what it timed: a spy on ``calibrate.best_seconds`` reads
each timed program's lowered text for the kernel's custom call (``arms_spy``), so a kernel arm that
ran XLA's dot fails however its figures compare (test_panel_head.py uses it for the panel head)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.config import ModelConfig
from jaxgpt.inference.generate import generate
from jaxgpt.models import abstract_params
from jaxgpt.nn.kernels import calibrate, matvec_ffi, native, panel_ffi

SOURCE = (native.CPU / "matvec.cc",)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path))
    monkeypatch.setenv(calibrate.ENV, "auto")
    matvec_ffi.wins.cache_clear()
    yield tmp_path
    matvec_ffi.wins.cache_clear()


def arms_spy(monkeypatch) -> list[tuple[set[str], np.ndarray]]:
    """Wrap calibrate.best_seconds: for each program timed, the kernel custom calls in its lowered text
    (matvec's and the panel head's FFI targets) and its output, recorded before the real timing runs."""
    seen = []
    real = calibrate.best_seconds

    def spy(fn, *args, **kw):
        text = fn.lower(*args).as_text()
        seen.append(({t for t in (matvec_ffi.TARGET, panel_ffi.TARGET) if t in text}, np.asarray(fn(*args))))
        return real(fn, *args, **kw)

    monkeypatch.setattr(calibrate, "best_seconds", spy)
    return seen


def counted(wins: bool):
    calls = []

    def measure():
        calls.append(1)
        return dict(wins=wins, kernel_s=1.0, xla_s=2.0)
    return measure, calls


def test_measured_once_then_read_back(cache):
    measure, calls = counted(False)
    assert calibrate.decide("rule", SOURCE, measure) is False
    assert calibrate.decide("rule", SOURCE, measure) is False
    assert len(calls) == 1, "the second call must read the stored answer"
    stored = json.loads(calibrate.path().read_text())
    (k, v), = stored.items()
    assert k == calibrate.key("rule", SOURCE) and v == dict(wins=False, kernel_s=1.0, xla_s=2.0)
    assert calibrate.cpu_model() in k and " ".join(native.isa_flags()) in k


def test_each_rule_and_instruction_set_has_its_own_answer(cache, monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "native")  # the suite may run capped (JAXGPT_KERNEL_ISA=avx2)
    first, _ = counted(True)
    calibrate.decide("rule", SOURCE, first)
    other, calls = counted(False)
    assert calibrate.decide("another", SOURCE, other) is False and len(calls) == 1
    monkeypatch.setenv(native.ISA_ENV, "portable")
    assert calibrate.decide("rule", SOURCE, other) is False and len(calls) == 2, "another ISA measures again"
    monkeypatch.setenv(native.ISA_ENV, "native")
    assert calibrate.decide("rule", SOURCE, other) is True, "the native answer is kept"
    assert len(json.loads(calibrate.path().read_text())) == 3


def test_off_runs_the_kernel_without_measuring_and_redo_measures_again(cache, monkeypatch):
    measure, calls = counted(False)
    monkeypatch.setenv(calibrate.ENV, "off")
    assert calibrate.decide("rule", SOURCE, measure) is True and not calls
    monkeypatch.setenv(calibrate.ENV, "redo")
    calibrate.decide("rule", SOURCE, measure)
    calibrate.decide("rule", SOURCE, measure)
    assert len(calls) == 2
    monkeypatch.setenv(calibrate.ENV, "sometimes")
    with pytest.raises(ValueError, match="JAXGPT_CALIBRATION='sometimes' is not one of"):
        calibrate.decide("rule", SOURCE, measure)


@pytest.mark.parametrize("kernel_wins", [True, False])
def test_generate_follows_the_stored_matvec_answer(cache, monkeypatch, kernel_wins):
    if not matvec_ffi.available():
        pytest.skip("no C++ compiler: the kernel cannot be built")
    measure, calls = counted(kernel_wins)
    monkeypatch.setattr(matvec_ffi, "_measure", measure)
    rows = []
    real = matvec_ffi.matvec
    monkeypatch.setattr(matvec_ffi, "matvec", lambda x, w: rows.append(x.shape[0]) or real(x, w))
    cfg = ModelConfig(vocab_size=31 + kernel_wins, d_model=32, n_layer=1, n_head=2, max_len=16)  # decoded as separate layers
    params = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(0).standard_normal(a.shape), a.dtype) * 0.1,
                          abstract_params(cfg))
    generate(cfg, params, np.zeros((1, 4), np.int32), 3)
    assert len(calls) == 1
    assert bool(rows) == kernel_wins


def test_a_rule_asked_while_tracing_measures_outside_the_trace(cache):
    """generate() asks the matvec rule while tracing its program; the measurement must still run (in
    the caller's thread JAX would stage its calls into the traced program and time nothing)."""
    seen = []

    def measure():
        seen.append(isinstance(jnp.ones(2) + 1, jax.core.Tracer))
        return dict(wins=True)

    jax.jit(lambda x: x + calibrate.decide("traced", SOURCE, measure))(jnp.zeros(2))
    assert seen == [False]


def test_the_matvec_measurement_times_both_paths(cache, monkeypatch):
    """The real measurement (about half a second): the kernel arm's program calls the kernel and the
    XLA arm's does not, both compute the same chain (1e-4: 24 float32 matvecs of up to 1,536 terms,
    summed in another order, whose rounding adds up to ~1e-5), both figures are set, and the rule's
    margin is applied to them."""
    if not matvec_ffi.available():
        pytest.skip("no C++ compiler: the kernel cannot be built")
    arms = arms_spy(monkeypatch)
    r = matvec_ffi._measure()
    assert [targets for targets, _ in arms] == [{matvec_ffi.TARGET}, set()], "each arm must time its own path"
    np.testing.assert_allclose(arms[0][1], arms[1][1], rtol=0, atol=1e-4)
    assert r["kernel_s"] > 0 and r["xla_s"] > 0
    assert r["wins"] == (r["kernel_s"] < matvec_ffi.MARGIN * r["xla_s"])
