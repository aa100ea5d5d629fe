"""The torch_ref half of a cross-framework experiment (exp_minigpt, exp_attnres), in its own process so
that torch's and XLA's thread pools do not compete: trains torch_ref with ``torch_ref.train.train`` from
the initial weights jaxgpt drew, on the same batches (``task.batch``), and reports the loss of every
step and the timing.

    run(config, tc, corpus, init_params, steps=None, threads=1)   # from the jaxgpt process: spawns
    python -m scripts.experiments.torch_side SPEC.json             # the worker (reports RESULT json)

SPEC: {"config": ModelConfig dict, "tc": TrainConfig dict, "corpus": built-in corpus name, "init":
path.npz of the flattened params ('a/b/c' keys), "steps": the first that many steps of tc's run,
"threads": torch intra-op threads}. Timing as jaxgpt's fit defines it: the first step apart
(``first_step_s``; allocations and warm-up), ``seconds`` = the other steps, ``ms_per_step`` = their median.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from scripts.harness import report, spawn


def flatten(tree, prefix: str = "") -> dict:
    """Nested params -> {'a/b/c': array} (what np.savez stores)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items"):
            out |= flatten(v, f"{prefix}{k}/")
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def unflatten(flat) -> dict:
    """The inverse of ``flatten`` (a dict or an open .npz)."""
    tree: dict = {}
    for key in flat.keys() if isinstance(flat, dict) else flat.files:
        node = tree
        *path, leaf = key.split("/")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = np.asarray(flat[key])
    return tree


def run(config, tc, corpus: str, init_params, *, steps: int | None = None, threads: int = 1) -> dict:
    """Train torch_ref in a worker process from ``init_params`` (jaxgpt's initial weights)."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        init, spec = Path(tmp) / "init.npz", Path(tmp) / "spec.json"
        np.savez(init, **flatten(jax.device_get(init_params)))
        spec.write_text(json.dumps({"config": config.to_dict(), "tc": tc.to_dict(), "corpus": corpus, "init": str(init),
                                    "steps": steps or tc.steps, "threads": threads}))
        return spawn(__name__, spec, check=True)


def worker(spec_path: str) -> dict:
    import torch

    import torch_ref
    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.data.tasks import load_task
    from torch_ref.convert import load_params
    from torch_ref.train import train

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec.get("threads", 1))
    config, tc = ModelConfig.from_dict(spec["config"]), TrainConfig.from_dict(spec["tc"])
    task = load_task(config, tc, corpus=spec["corpus"])
    with np.load(spec["init"]) as z:
        model = load_params(torch_ref.build(config), unflatten(z))
    rows = train(model, tc, task, steps=spec.get("steps", tc.steps))
    times = [r["seconds"] for r in rows]
    return {"losses": [r["loss"] for r in rows], "first_step_s": times[0], "seconds": float(sum(times[1:])),
            "ms_per_step": 1e3 * statistics.median(times[1:]) if len(times) > 1 else None,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    report(worker(sys.argv[1]))
