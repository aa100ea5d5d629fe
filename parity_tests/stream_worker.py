"""Subprocess side of test_hf_stream.py's sharded load: runs with 4 simulated CPU devices (XLA_FLAGS set
by the caller before JAX starts), loads DIR onto a fsdp=2,tensor=2 mesh while counting what every
``make_array_from_callback`` callback reads from the memory-mapped file, and prints one JSON line.

    python stream_worker.py DIR
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxgpt.convert import load_hf, stream
from jaxgpt.parallel.sharding import make_mesh

reads = []  # (piece shape, slice shape, bytes read) per read


def counting_read(source, index):
    part = source[index]
    reads.append((list(source.shape), list(part.shape), int(part.nbytes), source.dtype.itemsize))
    return part


def main(path: str) -> None:
    _, whole = load_hf(path)
    stream.read = counting_read
    mesh = make_mesh("fsdp=2,tensor=2")
    config, params = load_hf(path, mesh=mesh)
    flat = jax.tree_util.tree_leaves_with_path(params)
    equal = all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole)))
    q = next(a for p, a in flat if "q_proj" in jax.tree_util.keystr(p) and "kernel" in jax.tree_util.keystr(p))
    print("RESULT " + json.dumps({
        "devices": jax.device_count(), "equal": equal, "reads": reads,
        "q_spec": [str(s) for s in q.sharding.spec], "q_shard_shapes": [list(s.data.shape) for s in q.addressable_shards],
        "q_shape": list(q.shape)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
