"""Execution apart from the architecture (jaxgpt.config.execution): a checkpoint resumes under another
Execution, an architecture change is still refused, and configs and checkpoints written while the
execution keys lived in ModelConfig load, or fail in one line naming the migration.

The resume test is self-consistency (the same run, interrupted and continued with other kernels and
another layer layout, against itself uninterrupted): the kernels compute the same math, so the losses
agree to float32 rounding (1e-5); the per-kernel parity against torch_ref is test_engine_layers.py's.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxgpt.config import Execution, ModelConfig, apply_sets, get_preset, split_execution
from jaxgpt.models import abstract_params
from jaxgpt.nn.kernels import norm_ffi
from jaxgpt.train.checkpoint import Checkpoints
from jaxgpt.train.loop import fit, prepare
from jaxgpt.train.step import init_state

TINY = ["n_layer=2", "d_model=32", "d_ff=64", "batch_size=4", "seq_len=16", "steps=4", "ckpt_every=2", "eval_every=0",
        "log_every=1", "eval_batches=1", "val_fraction=0.0", "mesh="]  # one device
# the run's first half: einsum attention and XLA norms over a rolled scan of stacked layers
FIRST = ["exec.attention_impl=xla", "exec.norm_impl=xla", "exec.scan_layers=true", "exec.scan_unroll=1"]
# its second half: blocked attention (4-key blocks), the C++ norm where it is built, separate layers
SECOND = Execution(attention_impl="blocked", attention_block=4, norm_impl="ffi" if norm_ffi.available() else "xla",
                   scan_layers=False)


def _run(out: Path, sets: list[str], until: int | None = None, execution: Execution | None = None,
         checkpoints: bool = True) -> dict:
    config, tc = apply_sets(get_preset("seed-minigpt"), [*TINY, *sets])
    if execution is not None:
        tc = tc.replace(execution=execution)
    config, tc, task, state = prepare(out, config, tc, corpus="seed-synthetic")
    fit(config, tc, task, out, state=state, progress=False, log=lambda *a: None, until=until, checkpoints=checkpoints)
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    base = tmp_path_factory.mktemp("exec")
    whole = _run(base / "whole", FIRST, checkpoints=False)
    _run(base / "split", FIRST, until=2)
    split = _run(base / "split", FIRST, execution=SECOND)  # the given Execution wins on resume
    return base, whole, split


def test_resume_under_another_execution_continues_the_same_losses(resumed):
    base, whole, split = resumed
    assert sorted(whole) == sorted(split) == [1, 2, 3, 4]
    np.testing.assert_allclose([split[s] for s in (3, 4)], [whole[s] for s in (3, 4)], atol=1e-5, rtol=0)
    ckpts = Checkpoints(base / "split", create=False)
    _, tc, state, meta = ckpts.restore()
    assert tc.execution == SECOND and meta["train"]["execution"]["scan_layers"] is False
    assert "layers_1" in state.params and "layers" not in state.params  # saved in the layout it ran
    config, params, _ = ckpts.restore_params()  # for sampling: the default layout
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, abstract_params(config))
    ckpts.close()


def test_resume_refuses_an_architecture_change(resumed):
    base, _, _ = resumed
    config, tc = apply_sets(get_preset("seed-minigpt"), [*TINY, *FIRST, "norm_eps=1e-4"])
    with pytest.raises(ValueError, match=r"holds a run with other settings; to resume, drop the changes "
                                         r"\(norm_eps=0.0001 \(saved: "):
        prepare(base / "split", config, tc, corpus="seed-synthetic")


def test_old_configs_fail_in_one_line_naming_the_migration():
    message = r"^attention_impl moved to jaxgpt.config.Execution \(model.attention_impl -> exec.attention_impl\)"
    with pytest.raises(ValueError, match=message):
        ModelConfig(attention_impl="xla")
    with pytest.raises(ValueError, match=message):
        ModelConfig().replace(attention_impl="xla")
    old = {**ModelConfig().to_dict(), "attention_impl": "xla", "scan_layers": False}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(old)
    arch, ex = split_execution(old)
    assert ModelConfig.from_dict(arch) == ModelConfig() and Execution(**ex) == Execution(attention_impl="xla",
                                                                                        scan_layers=False)
    # the --set spellings from before: the bare key, or with the model's prefix, go to TrainConfig.execution
    _, tc = apply_sets(ModelConfig(), ["attention_impl=xla", "model.scan_unroll=2"])
    assert tc.execution == Execution(attention_impl="xla", scan_unroll=2)


def test_an_old_checkpoint_loads_with_its_execution(tmp_path):
    """A checkpoint whose saved ModelConfig holds execution keys (separate layers, 'xla' attention):
    restore gives them as TrainConfig.execution and the state in its layout; restore_params the
    default layout."""
    config, tc = apply_sets(get_preset("seed-minigpt"), TINY)
    ex = Execution(scan_layers=False, attention_impl="xla")
    state = init_state(config, tc.replace(execution=ex), mesh=None)
    train = {k: v for k, v in tc.to_dict().items() if k != "execution"}  # written before TrainConfig had one
    old = {"config": {**config.to_dict(), **{k: v for k, v in ex.to_dict().items() if k != "platform"}},
           "train": train, "tokenizer": None, "source": "test", "kind": "lm"}
    ckpts = Checkpoints(tmp_path, keep=1, mesh=None)
    ckpts.save(state, old)
    ckpts.wait()
    got_config, got_tc, got_state, _ = ckpts.restore()
    assert got_config == config and got_tc.execution == ex
    assert jax.tree.all(jax.tree.map(np.array_equal, got_state.params, jax.device_get(state.params)))
    _, params, _ = ckpts.restore_params()
    assert "layers" in params and np.array_equal(params["layers"]["attn"]["q_proj"]["kernel"][1],
                                                 state.params["layers_1"]["attn"]["q_proj"]["kernel"])
    ckpts.close()
