"""Checked mode: the same input checks as ``jaxgpt.core.validate``, but jit-safe (jax.experimental.checkify).

Under ``jax.jit`` a value is a tracer and cannot raise, and JAX clamps bad gather / update
indices silently. So the models, the loss and the KV cache also state their checks with
``debug_check`` (``checkify.debug_check``), traced only inside ``checking()``: elsewhere the
program has no trace of them (a debug_check left outside checkify is compiled away, but its error
effect stays on the jaxpr and turns off jit's C++ dispatch, which costs Python time on every call
of the serving engine's step: docs/performance.md). ``checked(fn)`` traces fn inside ``checking()`` under
``checkify.checkify`` and raises the first failure as a ValueError:

    from jaxgpt.nn.checks import checked
    forward = checked(lambda p, x: model.apply({"params": p}, x))   # jit-compiled, checked
    forward(params, tokens)   # ValueError: token id 70 is outside the vocabulary [0, 64) ...

Static arguments (a config, flags) must be closed over, not passed: checkify traces every
argument. Limitation (JAX 0.10): a check inside a ``lax.scan`` that is differentiated
(``jax.grad`` of the scan) is lost, so the checks sit outside the scanned layers (DecoderLM checks
ids and cache room before its ``nn.scan``) and the train step checks its whole batch up front
(``debug_check_batch``), which also names the batch key and the micro-batch in the message.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxgpt.core.constants import IGNORE_INDEX


class _State(threading.local):  # tracing happens on the calling thread
    on = False  # inside checking(): traced checks are built into the program


STATE = _State()  # read ``STATE.on`` to build a check only in checked mode (no dead ops in other programs)


@contextlib.contextmanager
def checking():
    """Trace the checks (``debug_check``) of code traced inside this context; ``checked`` enters it.
    For your own ``checkify.checkify(fn)``, trace fn inside it."""
    before = STATE.on
    STATE.on = True
    try:
        yield
    finally:
        STATE.on = before


def debug_check(pred, msg: str, **fmt) -> None:
    """``checkify.debug_check(pred, msg, **fmt)`` inside ``checking()``; nothing elsewhere."""
    if STATE.on:
        checkify.debug_check(pred, msg, **fmt)


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_in_range(x, limit: int, what: str, *, space: str = "the vocabulary", allow: int | None = None) -> None:
    """debug_check: every element of int array ``x`` in [0, limit) (or equal to ``allow``)."""
    bad = (x < 0) | (x >= limit)
    if allow is not None:
        bad = bad & (x != allow)
    i = jnp.argmax(bad.ravel())  # first offender, reported with its value and position
    pos = {f"p{d}": j for d, j in enumerate(jnp.unravel_index(i, x.shape))}
    where = "(" + ", ".join(f"{{{k}}}" for k in pos) + ("," if len(pos) == 1 else "") + ")"  # like a tuple
    extra = "" if allow is None else f" and is not the ignore index {allow}"
    space = f"{space} " if space else ""
    debug_check(~bad.any(), f"{what} {{value}} is outside {space}[0, {limit}){extra} at position {where}",
                         value=x.ravel()[i], **pos)


def check_cache_room(cached, new: int, capacity: int) -> None:
    """debug_check for a traced KV cache index (jaxgpt.core.validate.check_cache_room when concrete)."""
    debug_check(cached + new <= capacity,
                         f"KV cache overflow: {{cached}} cached + {new} new > capacity {capacity}", cached=cached)


def debug_check_batch(batch: dict, config) -> None:
    """debug_check every id, target and label of a (possibly traced) batch; see validate.check_batch."""
    from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig

    if isinstance(config, ModelConfig):
        check_in_range(batch["x"], config.vocab_size, "batch['x']: token id")
        check_in_range(batch["y"], config.vocab_size, "batch['y']: target", space="", allow=IGNORE_INDEX)
    elif isinstance(config, BertConfig):
        check_in_range(batch["input_ids"], config.encoder.vocab_size, "batch['input_ids']: token id")
        check_in_range(batch["labels"], config.n_classes, "batch['labels']: label", space="the classes")
    elif isinstance(config, EncDecConfig):
        check_in_range(batch["src"], config.encoder.vocab_size, "batch['src']: token id")
        check_in_range(batch["tgt"], config.decoder.vocab_size, "batch['tgt']: token id")
        check_in_range(batch["labels"], config.decoder.vocab_size, "batch['labels']: target", space="",
                       allow=IGNORE_INDEX)


def raise_if_failed(err: checkify.Error) -> None:
    msg = err.get()
    if msg is not None:
        raise ValueError(msg.removesuffix(" (`check` failed)"))


def checked(fn, *, jit: bool = True, **jit_kwargs):
    """``fn`` with its checkify checks active: returns fn's output, or raises ValueError with the
    first failed check's message. ``jit`` compiles the checked function (``jit_kwargs`` go to
    ``jax.jit``, e.g. ``donate_argnums``). The check adds a device-to-host read of one flag per call."""
    def traced(*args, **kwargs):
        with checking():
            return fn(*args, **kwargs)

    cfn = checkify.checkify(traced, errors=checkify.user_checks)
    if jit:
        cfn = jax.jit(cfn, **jit_kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        err, out = cfn(*args, **kwargs)
        raise_if_failed(err)
        return out

    return run


__all__ = ["check_cache_room", "check_in_range", "checked", "checking", "debug_check", "debug_check_batch", "is_traced",
           "raise_if_failed"]
