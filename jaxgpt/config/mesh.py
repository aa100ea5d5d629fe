"""The ``--mesh data=N,fsdp=M,tensor=K`` syntax, framework-free so that TrainConfig (which imports
no framework) can validate it; ``jaxgpt.parallel.sharding`` builds the jax Mesh from it."""
from __future__ import annotations

import math

# batch split / params split (ZeRO-3) / MoE experts split (expert parallelism; the batch is split over it
# too) / Megatron heads and MLP width
AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes a batch's rows are split over


def parse_mesh(spec: str, n_devices: int | None = None) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1}; an omitted axis is 1. With
    ``n_devices`` the product must equal it."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or name not in AXES or name in seen or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad mesh {spec!r}: expected comma-separated AXIS=N with AXIS one of "
                             f"{', '.join(AXES)} (each at most once) and N >= 1, e.g. 'data=2,fsdp=4'; got {part!r}")
        seen.add(name)
        sizes[name] = int(value)
    if not seen:
        raise ValueError(f"bad mesh {spec!r}: name at least one axis, e.g. 'data=8'")
    total = math.prod(sizes.values())
    if n_devices is not None and total != n_devices:
        raise ValueError(f"mesh {spec!r} needs {total} devices (data*fsdp*expert*tensor), but {n_devices} are available; "
                         "make the product equal the device count (on a CPU, more host devices: "
                         "jaxgpt.parallel.sharding.use_host_devices(n) before JAX starts)")
    return sizes


def batch_devices(sizes) -> int:
    """How many ways a mesh (``parse_mesh`` dict or ``Mesh.shape``) splits a batch's rows: data*fsdp*expert."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def mesh_devices(spec: str) -> int:
    """Number of devices the mesh ``spec`` spans."""
    return math.prod(parse_mesh(spec).values())


__all__ = ["AXES", "BATCH_AXES", "batch_devices", "mesh_devices", "parse_mesh"]
