"""Orbax checkpoints: ``DIR/checkpoints/<step>/{params, train, meta}``.

``params`` and ``train`` (step, optimizer state, rng) are separate items so that sampling and
evaluation restore the weights alone; ``meta`` is JSON (model config, training config,
tokenizer, data source). Restores go into abstract targets from ``jax.eval_shape``, so nothing
is allocated twice and a shape mismatch is an error, not a silent reshape.
"""
from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from jaxgpt.config import TrainConfig, config_from_dict
from jaxgpt.convert.external import abstract_params
from jaxgpt.train.step import TrainState, abstract_state

FORMAT = "jaxgpt-checkpoint/1"


def checkpoint_dir(path: str | Path, create: bool = False) -> Path:
    """``path/checkpoints`` for a run directory; an existing checkpoints directory as it is."""
    p = Path(path).absolute()
    return p / "checkpoints" if create or (p / "checkpoints").is_dir() else p


class Checkpoints:
    """Save every N steps, keep the last K, restore the latest (or a given) step."""

    def __init__(self, path: str | Path, keep: int = 3, *, create: bool = True):
        self.dir = checkpoint_dir(path, create)
        if not create and not self.dir.is_dir():
            raise FileNotFoundError(f"no checkpoints at {str(path)!r} (looked in {str(self.dir)!r})")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
        self._mngr = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self._mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {str(self.dir)!r}; "
                                    f"saved steps: {self.steps() or 'none'}")
        return step

    def save(self, state: TrainState, meta: dict) -> None:
        """Asynchronous: returns once the arrays are copied off the device."""
        train = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
        self._mngr.save(int(state.step), args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave({"format": FORMAT, **meta})))

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def meta(self, step: int | None = None) -> dict:
        meta = self._mngr.restore(self._step(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"{str(self.dir)!r} holds format {meta.get('format')!r}, expected {FORMAT!r}")
        return meta

    def restore(self, step: int | None = None) -> tuple[object, TrainConfig, TrainState, dict]:
        """-> (model config, TrainConfig, full TrainState, meta) for resuming."""
        step = self._step(step)
        meta = self.meta(step)
        config, tc = config_from_dict(meta["config"]), TrainConfig.from_dict(meta["train"])
        target = abstract_state(config, tc)
        train = {"step": target.step, "opt_state": target.opt_state, "rng": target.rng}
        out = self._mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target.params), train=ocp.args.StandardRestore(train)))
        return config, tc, TrainState(params=out["params"], **out["train"]), meta

    def restore_params(self, step: int | None = None) -> tuple[object, dict, dict]:
        """-> (model config, params, meta): the weights alone, for sampling and evaluation."""
        step = self._step(step)
        meta = self.meta(step)
        config = config_from_dict(meta["config"])
        out = self._mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params(config))))
        return config, out["params"], meta

    def close(self) -> None:
        self._mngr.close()
