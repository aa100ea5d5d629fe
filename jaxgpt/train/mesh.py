"""A run's devices: ``TrainConfig.mesh`` becomes a jax ``Mesh``, or None for one device, in one place
(``resolve_mesh``). The plan resolves it once a run; the programs, the state and the loop take the
resolved value, and the public entry points that accept 'auto' resolve it on their first line.
"""
from __future__ import annotations

from jax.sharding import Mesh

from jaxgpt.config import TrainConfig
from jaxgpt.parallel.sharding import auto_mesh, make_mesh


def resolve_mesh(tc: TrainConfig, mesh: Mesh | str | None = "auto") -> Mesh | None:
    """``mesh`` when given (a Mesh, or None: one device); 'auto': ``tc.mesh``'s, where '' -> None (the
    single-device path), 'auto' -> ``sharding.auto_mesh`` (this host's CPU devices, as many as divide the
    micro-batch) and a spec ('data=2,fsdp=4') -> ``sharding.make_mesh``."""
    if not isinstance(mesh, str):
        return mesh
    if mesh != "auto":
        raise ValueError(f"mesh={mesh!r}: pass a Mesh, None (one device) or 'auto' (from TrainConfig.mesh)")
    if tc.mesh == "auto":
        return auto_mesh(tc.micro_batch)
    return make_mesh(tc.mesh) if tc.mesh else None


__all__ = ["resolve_mesh"]
