"""Issue 52: a GPT-2 forward and a LLaMA forward each run at most 8 files of jaxgpt outside the kernels.

Counted while tracing ``model.apply`` under ``jax.jit(...).trace`` (no compilation): every Python frame
whose code lives under jaxgpt/, minus nn/kernels/ (the speed paths behind the ops, and the execution
policy: exec_policy.py, precision.py). Not a comparison with a reference: a structural count.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxgpt
from jaxgpt.config import get_preset
from jaxgpt.models import DecoderLM

ROOT = os.path.dirname(jaxgpt.__file__)
OUTSIDE = (os.path.join("nn", "kernels") + os.sep,)
MAX_FILES = 8


def forward_files(config) -> dict[str, set[str]]:
    """{file under jaxgpt/: the functions of it that ran} while tracing a forward of ``config``."""
    model, tokens = DecoderLM(config), jnp.zeros((2, 8), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens))["params"]
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(ROOT + os.sep):
            seen.setdefault(os.path.relpath(path, ROOT), set()).add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        jax.jit(lambda p, t: model.apply({"params": p}, t)).trace(params, tokens)
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("preset", ["gpt2-small", "llama-tiny"])
def test_a_forward_runs_at_most_8_model_files(preset):
    cfg = get_preset(preset)
    cfg = cfg.replace(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=64, max_len=16,
                      **({"n_kv_head": 2} if cfg.n_kv_head else {}))
    seen = forward_files(cfg)
    model = sorted(f for f in seen if not f.startswith(OUTSIDE))
    print(f"{preset}: {len(model)} model files ({len(seen)} under jaxgpt/ with the kernels and execution modes): {model}")
    assert "models/decoder.py" in model and any(f.startswith(OUTSIDE[0]) for f in seen), "the profile saw no forward"
    assert len(model) <= MAX_FILES, f"{preset}'s forward runs {len(model)} files outside nn/kernels/: {model}"
