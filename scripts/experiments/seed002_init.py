"""Seed 002's own initial weights for jaxgpt: the seed's model classes, exec'd from
../shared/seeds/002_*.txt and built after ``torch.manual_seed(seed)``, so every Linear gets torch's
default init (kaiming-uniform, U(+-1/sqrt(fan_in))), the embedding N(0, 1), norms 1 and the
pseudo-queries 0, exactly as the seed's script draws them. Converted with
``jaxgpt.convert.from_seed_attnres``.

torch runs in a subprocess (``python -m scripts.experiments.seed002_init SPEC``): jaxgpt's process never
imports torch, so its timings share no thread pool with torch's.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from scripts.harness import SHARED, report, spawn

SEED_FILE = SHARED / "seeds" / "002_cf3e92bca7241f9e.txt"
CLASSES = {"standard": "StandardTransformer", "full": "FullAttnResTransformer", "block": "BlockAttnResTransformer"}


def seed_namespace(path: Path = SEED_FILE) -> dict:
    """Seed 002's final model code (the second ``class SimpleAttention`` .. ``BlockAttnResTransformer``), exec'd."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: seed 002's text sits in ../shared/seeds beside the repository")
    lines = path.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("class SimpleAttention")]
    end_cls = next(i for i, line in enumerate(lines) if line.startswith("class BlockAttnResTransformer"))
    end = next(i for i in range(end_cls + 1, len(lines)) if lines[i].startswith(("def ", "class ", "# ═")))
    if len(starts) != 2:
        raise ValueError(f"expected two SimpleAttention definitions in {path}, found {len(starts)}")
    ns = {"torch": torch, "nn": nn, "F": F, "math": math, "__name__": "seed002"}
    exec(compile("\n".join(lines[starts[1]:end]), str(path), "exec"), ns)
    return ns


def build(ns: dict, kind: str, d: int, n_layers: int, n_heads: int, vocab: int, n_blocks: int):
    """The seed's constructor call for ``kind`` (its main() passes n_blocks to Block only)."""
    args = (d, n_layers, n_heads, vocab) + ((n_blocks,) if kind == "block" else ())
    return ns[CLASSES[kind]](*args)


def _worker(spec_path: Path) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    ns = seed_namespace()
    torch.manual_seed(spec["seed"])
    model = build(ns, spec["kind"], spec["d"], spec["n_layers"], spec["n_heads"], spec["vocab"], spec["n_blocks"])
    np.savez(spec["out"], **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    report({"out": spec["out"]})


def seed_init(config, kind: str, seed: int) -> dict:
    """jaxgpt params for ``config`` (a seed-attnres preset fitted to the task, either variant) drawn
    as seed 002 draws them under ``torch.manual_seed(seed)``.

    The 'paper' variant has leaves the seed's model lacks (a key norm per sublayer, the output
    pseudo-query): they keep jaxgpt's init, which is the seed's for those kinds (norm scales 1,
    queries 0); anything else left unmatched is an error.
    """
    import jax
    import jax.numpy as jnp

    from jaxgpt.convert import from_seed_attnres
    from jaxgpt.models import DecoderLM

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "init.npz"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"kind": kind, "seed": seed, "d": config.d_model, "n_layers": config.n_layer,
                                    "n_heads": config.n_head, "vocab": config.vocab_size,
                                    "n_blocks": config.attnres_blocks, "out": str(out)}))
        spawn(__name__, spec, check=True)
        with np.load(out) as z:
            sd = {k: z[k] for k in z.files}
    _, src = from_seed_attnres(sd, kind, n_head=config.n_head, attnres_blocks=config.attnres_blocks)
    target = jax.device_get(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    flat_src = dict(jax.tree_util.tree_leaves_with_path(src))
    flat_target = jax.tree_util.tree_leaves_with_path(target)
    leaves = []
    for path, leaf in flat_target:
        if path in flat_src:
            if flat_src[path].shape != leaf.shape:
                raise ValueError(f"{jax.tree_util.keystr(path)}: seed shape {flat_src[path].shape} != {leaf.shape}")
            leaves.append(np.asarray(flat_src[path], leaf.dtype))
        elif np.all(leaf == 1) or np.all(leaf == 0):  # a key norm (1) or a pseudo-query (0): the seed's init too
            leaves.append(leaf)
        else:
            raise ValueError(f"{jax.tree_util.keystr(path)} has no counterpart in seed 002's {kind} model")
    targets = {p for p, _ in flat_target}
    # the seed variant's shared key norm has no 'paper' counterpart; at init it is all ones, nothing drawn
    missing = [p for p in flat_src if p not in targets and not np.all(flat_src[p] == 1)]
    if missing:
        raise ValueError(f"seed leaves without a jaxgpt counterpart: {sorted(map(jax.tree_util.keystr, missing))}")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
