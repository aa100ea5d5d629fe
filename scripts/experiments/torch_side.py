"""torch_ref side of scripts/exp_minigpt.py (experiment 6 for experiment 2), run in its own process
so that torch's and XLA's thread pools do not compete: trains torch_ref from the initial weights
jaxgpt drew (an .npz of flattened params) on the same batches (``task.batch``) and writes the loss
per step and the wall-clock ms/step.

    python scripts/exp_minigpt_torch.py SPEC.json OUT.json

SPEC: {"config": ModelConfig dict, "tc": TrainConfig dict, "corpus": name, "init": path.npz,
"steps": the first that many steps of tc's run}.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def unflatten(flat) -> dict:
    tree: dict = {}
    for key in flat.files:
        node = tree
        *path, leaf = key.split("/")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = np.asarray(flat[key])
    return tree


def main(spec_path: str, out_path: str) -> None:
    import torch

    import torch_ref
    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.train.tasks import load_task
    from torch_ref.convert import load_params
    from torch_ref.train import make_optimizer, train_step

    spec = json.loads(open(spec_path).read())
    config, tc = ModelConfig.from_dict(spec["config"]), TrainConfig.from_dict(spec["tc"])
    task = load_task(config, tc, corpus=spec["corpus"])
    model = load_params(torch_ref.build(config), unflatten(np.load(spec["init"])))
    opt, sched = make_optimizer(model, tc)
    losses, windows, t_win, n_win = [], [], None, 0
    t_all = time.perf_counter()
    steps = spec.get("steps", tc.steps)
    for step in range(steps):
        m = train_step(model, opt, sched, tc, task.batch(tc, step))
        losses.append(m["loss"])
        if step == 0:  # the first step (allocations) is left out of the timing, as jaxgpt's compile is
            t_win = time.perf_counter()
            continue
        n_win += 1
        if (step + 1) % 10 == 0 or step + 1 == steps:
            now = time.perf_counter()
            windows.append((now - t_win) / n_win)
            t_win, n_win = now, 0
    out = {"losses": losses, "seconds": time.perf_counter() - t_all, "torch": torch.__version__,
           "threads": torch.get_num_threads(),
           "ms_per_step": 1e3 * statistics.median(windows) if windows else None}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
