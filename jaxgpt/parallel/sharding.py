"""Sharded training on JAX's SPMD engine: a ('data', 'fsdp', 'expert', 'tensor') mesh and where every array lives.

The model code carries no sharding annotations (it is shared with the single-device path and the
torch mirror). Instead, MaxText-style, two explicit rule tables decide placement, and ``jax.jit``
propagates the rest (activations follow their inputs and the parameters):

- parameter path -> logical axes: ``PARAM_RULES`` keyed by (module, leaf) name, e.g. q_proj kernel
  ('embed', 'heads'), o_proj kernel ('heads', 'embed'); a leading layer axis from ``nn.scan`` is
  'layers' (never sharded). An unknown path is a ValueError, so a new parameter cannot silently
  stay unsharded.
- logical axis -> mesh axis: ``LOGICAL_RULES``; batch over ('data', 'fsdp', 'expert'), embed over 'fsdp'
  (FSDP / ZeRO-3: params and Adam moments are split, gathered where used), heads / kv_heads / mlp /
  vocab over 'tensor' (Megatron: q/k/v and gate/up column-split, o/down row-split), the experts of
  a MoE layer over 'expert' (expert parallelism: each device of the axis holds E/expert experts and
  its own rows of the batch; XLA moves the tokens to their experts and back, or with MoE impl
  'alltoall' an explicit all-to-all does: jaxgpt/nn/moe_dispatch.py).

A dimension that does not divide by its mesh axes is replicated over them rather than padded:
with GQA, kv heads that do not divide by the tensor size (n_kv_head 2, tensor 8) leave k_proj and
v_proj whole on every tensor device (each device then computes the kv heads its query heads need;
XLA inserts the slices). The math is the same on every mesh; only the placement changes, and not
silently: ``param_specs`` warns (``ReplicationWarning``, once per model and mesh) naming each
parameter a mesh axis cannot split where its rule says to, with the share of all parameters left
whole over each axis; ``unsplit`` returns the same as data.
"""
from __future__ import annotations

import contextlib
import math
import re
import warnings

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config.mesh import AXES, BATCH_AXES, batch_devices, mesh_devices, parse_mesh
from jaxgpt.parallel.host_devices import use_host_devices

BATCH = BATCH_AXES  # mesh axes the batch is split over: ('data', 'fsdp', 'expert')

# logical axis -> mesh axis (None: replicated). flax.linen's rule format.
LOGICAL_RULES = (("batch", BATCH), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
                 ("mlp", "tensor"), ("vocab", "tensor"), ("layers", None), ("norm", None), ("table", None),
                 ("classes", None), ("embed_out", None), ("expert", "expert"), ("router", None))

_PROJ = {"kernel": ("embed", "heads"), "bias": ("heads",)}
_KV = {"kernel": ("embed", "kv_heads"), "bias": ("kv_heads",)}
_OUT = {"kernel": ("heads", "embed"), "bias": ("embed",)}
_UP = {"kernel": ("embed", "mlp"), "bias": ("mlp",)}
_DOWN = {"kernel": ("mlp", "embed"), "bias": ("embed",)}
_NORM = {"scale": ("norm",), "bias": ("norm",)}
# (module name, leaf name) -> logical axes of the unstacked leaf.
PARAM_RULES: dict[str, dict[str, tuple]] = {
    "q_proj": _PROJ, "k_proj": _KV, "v_proj": _KV, "o_proj": _OUT,
    "gate_proj": _UP, "up_proj": _UP, "fc_in": _UP, "down_proj": _DOWN, "fc_out": _DOWN,
    "tok_embed": {"embedding": ("vocab", "embed")},
    "pos_embed": {"embedding": ("table", "embed")}, "type_embed": {"embedding": ("table", "embed")},
    "lm_head": {"kernel": ("embed", "vocab"), "bias": ("vocab",)},
    "out_proj": {"kernel": ("embed", "vocab"), "bias": ("vocab",)},  # the encoder-decoder's LM head
    "classifier": {"kernel": ("embed", "classes"), "bias": ("classes",)},
    "pooler": {"kernel": ("embed", "embed_out"), "bias": ("embed_out",)},
    # Mixture of Experts (jaxgpt.nn.moe): stacked (E, in, out) experts split by expert; routers whole
    "experts": {"gate_proj": ("expert", "embed", "mlp"), "up_proj": ("expert", "embed", "mlp"),
                "down_proj": ("expert", "mlp", "embed")},
    "router": {"kernel": ("embed", "router")}, "shared_expert_gate": {"kernel": ("embed", "router")},
}
_NORM_MODULE = re.compile(r"(^|_)norm$")  # norm, attn_norm, mlp_norm, cross_norm, key_norm, embed_norm
_LEAF_RULES = {"w_attn": ("norm",), "w_mlp": ("norm",), "w_out": ("norm",)}  # Attention Residuals queries: (d_model,)


def auto_mesh(micro_batch: int | None = None) -> Mesh | None:
    """``TrainConfig.mesh='auto'``: a 'data' mesh over this host's CPU devices (as many as divide
    ``micro_batch``), or None (one device) on an accelerator, on several processes, or with one
    CPU device. Data parallel only: params stay whole, so the math is the single-device step's."""
    if jax.default_backend() != "cpu" or jax.process_count() > 1:
        return None
    devices = jax.local_devices()
    n = max(d for d in range(1, len(devices) + 1) if not micro_batch or micro_batch % d == 0)
    return make_mesh({a: n if a == "data" else 1 for a in AXES}, devices[:n]) if n > 1 else None


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A Mesh with axes ('data', 'fsdp', 'expert', 'tensor') over ``devices`` (default: all, every process)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = parse_mesh(spec, len(devices)) if isinstance(spec, str) else spec
    shape = tuple(sizes[a] for a in AXES)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {sizes} needs {int(np.prod(shape))} devices, but {len(devices)} are available")
    try:  # topology-aware order (tensor innermost, on the fastest links) where JAX knows it
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001 - e.g. odd device counts; plain order is still correct
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES)


# -- parameters ---------------------------------------------------------------------------------
def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def logical_axes(path, ndim: int) -> tuple:
    """Logical axes of one parameter leaf from its tree path; a leading 'layers' axis when stacked."""
    names = _names(path)
    leaf, module = names[-1], (names[-2] if len(names) > 1 else "")
    if leaf in _LEAF_RULES:
        axes = _LEAF_RULES[leaf]
    elif _NORM_MODULE.search(module) and leaf in _NORM:
        axes = _NORM[leaf]
    elif module in PARAM_RULES and leaf in PARAM_RULES[module]:
        axes = PARAM_RULES[module][leaf]
    else:
        raise ValueError(f"no sharding rule for parameter {'/'.join(names)!r}; add its module to "
                         "jaxgpt.parallel.sharding.PARAM_RULES (logical axes per leaf)")
    if ndim == len(axes) + 1:  # nn.scan's stacked copy: (L, ...)
        return ("layers",) + axes
    if ndim != len(axes):
        raise ValueError(f"parameter {'/'.join(names)!r} has {ndim} dims; its rule {axes} expects {len(axes)} "
                         f"(or {len(axes) + 1} stacked)")
    return axes


def _rules(config, mesh: Mesh) -> tuple:
    """LOGICAL_RULES, less the head splits that would cut a head across devices."""
    t = mesh.shape["tensor"]
    drop = set()
    stacks = [getattr(config, k) for k in ("encoder", "decoder") if hasattr(config, k)] or [config]  # Bert, EncDec
    if any(c.n_head % t for c in stacks):
        drop.add("heads")
    if any(c.kv_heads % t for c in stacks):
        drop.add("kv_heads")  # GQA with kv heads < tensor size: k_proj/v_proj replicated over 'tensor'
    return tuple((k, None if k in drop else v) for k, v in LOGICAL_RULES)


def _spec(axes: tuple, shape: tuple, mesh: Mesh, rules) -> P:
    """PartitionSpec of one array: flax's logical -> mesh mapping, then any dim that does not
    divide by its mesh axes replicated (jit shardings must divide evenly)."""
    spec = list(nn.logical_to_mesh_axes(axes, rules))
    for i, (dim, ax) in enumerate(zip(shape, spec)):
        size = int(np.prod([mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax or ())]))
        if dim % size:
            spec[i] = None
    return P(*spec)


def _param_specs(config, params, mesh: Mesh):
    rules = _rules(config, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _spec(logical_axes(path, len(x.shape)), x.shape, mesh, rules), params)


def param_specs(config, params, mesh: Mesh):
    """Tree of PartitionSpecs matching ``params`` (arrays or ShapeDtypeStructs). Warns
    (``ReplicationWarning``) when the mesh cannot split some parameters as their rules say."""
    specs = _param_specs(config, params, mesh)
    report = unsplit(config, params, mesh, specs)
    if report["failed"] and jax.process_index() == 0:  # multi-host: by process 0 only
        # issued from this one line: Python's default filter shows each message once per process
        warnings.warn(replication_message(report), ReplicationWarning, stacklevel=2)
    return specs


class ReplicationWarning(UserWarning):
    """A mesh axis cannot split some parameters that its rules assign to it: they stay whole on
    every device of that axis (correct, but the memory per device is larger than the mesh suggests)."""


def _mesh_axes(entry) -> tuple:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def unsplit(config, params, mesh: Mesh, specs=None) -> dict:
    """What ``mesh`` leaves whole. {'mesh': 'fsdp=4,tensor=2', 'total': parameter count,
    'replicated': {axis: parameters not split over it} for every parameter-splitting axis (fsdp,
    tensor) of size > 1, 'failed': [{'param', 'shape', 'axis', 'size', 'reason', 'hint'}] for each
    parameter an axis's rule says to split but cannot (a dimension, or the head count, that is not
    a multiple of the axis size)}. Parameters whose rules never split them over an axis (norms,
    position tables, d_model biases over 'tensor') are replicated by design: counted, not listed."""
    specs = _param_specs(config, params, mesh) if specs is None else specs
    rules = _rules(config, mesh)
    stacks = [getattr(config, k) for k in ("encoder", "decoder") if hasattr(config, k)] or [config]
    gqa = any(c.kv_heads != c.n_head for c in stacks)
    heads = {"heads": ("n_head", [c.n_head for c in stacks]),
             "kv_heads": ("n_kv_head" if gqa else "n_head", [c.kv_heads for c in stacks])}
    dropped = {k for k, v in rules if v is None} - {k for k, v in LOGICAL_RULES if v is None}
    axes = [a for a in ("fsdp", "expert", "tensor") if mesh.shape.get(a, 1) > 1]
    total, replicated, failed = 0, dict.fromkeys(axes, 0), []
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, x), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P))):
        n = math.prod(x.shape)
        total += n
        used = {a for e in spec for a in _mesh_axes(e)}
        for a in axes:
            replicated[a] += n * (a not in used)
        logical = logical_axes(path, len(x.shape))
        wanted = nn.logical_to_mesh_axes(logical, LOGICAL_RULES)
        for dim, name, want in zip(x.shape, logical, wanted):
            for a in _mesh_axes(want):
                if a not in axes or a in used:
                    continue
                size = mesh.shape[a]
                if name in dropped:
                    what, counts = heads[name]
                    bad = "/".join(map(str, sorted({h for h in counts if h % size})))
                    reason = f"{what}={bad} is not a multiple of {a}={size} (a head would be cut)"
                    hint = f"a {a} size that divides {what}={bad}"
                else:
                    reason = f"its {name} dimension {dim} is not a multiple of {a}={size}"
                    hint = f"vocab_size={-(-dim // size) * size} (a multiple of {a}={size})" if name == "vocab" \
                        else f"a {name} dimension that is a multiple of {a}={size}"
                failed.append({"param": "/".join(_names(path)), "shape": tuple(x.shape), "axis": a, "size": size,
                               "reason": reason, "hint": hint})
    spec = ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    return {"mesh": spec, "total": total, "replicated": replicated, "failed": failed}


def replication_message(report: dict, limit: int = 6) -> str:
    """The ``ReplicationWarning`` text of an ``unsplit`` report: the parameters (grouped by
    reason, at most ``limit`` named), then the share left whole over each axis."""
    groups: dict[str, list[str]] = {}
    for f in report["failed"]:
        groups.setdefault(f["reason"], []).append(f"{f['param']} {f['shape']}")
    parts, named = [], 0
    for reason, params in groups.items():
        shown = params[:max(limit - named, 1)]
        named += len(shown)
        more = f" and {len(params) - len(shown)} more" if len(params) > len(shown) else ""
        parts.append(f"{', '.join(shown)}{more}: {reason}")
    n, total = len(report["failed"]), report["total"]
    by_axis = {}
    for f in report["failed"]:
        by_axis.setdefault(f["axis"], {})[f["param"]] = math.prod(f["shape"])
    shares = []
    for a, count in report["replicated"].items():
        share = f"{a} {count / total:.1%} ({count:,} of {total:,}"
        if a in by_axis:
            share += f"; {sum(by_axis[a].values()) / total:.1%} from the parameters above"
        shares.append(share + ")")
    hints = list(dict.fromkeys(f["hint"] for f in report["failed"]))
    axes = "/".join(dict.fromkeys(f["axis"] for f in report["failed"]))
    return (f"mesh {report['mesh']} cannot split {n} parameter{'s' if n > 1 else ''} as the sharding rules say, "
            f"so {'they stay' if n > 1 else 'it stays'} whole (replicated) over {axes}: {'; '.join(parts)}. "
            f"Parameters left whole over each axis: {', '.join(shares)}. Training is still correct, but each "
            f"device holds more than the mesh suggests; to split them: {'; '.join(hints)}; or a smaller axis")


def param_shardings(config, params, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, params, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def state_shardings(config, state, mesh: Mesh):
    """NamedShardings for a TrainState (arrays or ShapeDtypeStructs): params by the rules, each
    optimizer moment like the parameter it belongs to (matched by its path's dict keys), the rest
    (step, rng, counts) replicated."""
    by_path = {}
    specs = param_specs(config, state.params, mesh)
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
        by_path[tuple(_names(path))] = spec

    def opt(path, x):
        keys = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        spec = by_path.get(keys)
        return NamedSharding(mesh, spec if spec is not None and len(spec) == len(x.shape) else P())

    rep = NamedSharding(mesh, P())
    return state.replace(step=rep, rng=rep, params=jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                                is_leaf=lambda x: isinstance(x, P)),
                         opt_state=jax.tree_util.tree_map_with_path(opt, state.opt_state))


def batch_sharding(mesh: Mesh, lead: int = 1) -> NamedSharding:
    """Rows over ('data', 'fsdp', 'expert') on axis ``lead``; the axes before it stay whole: 1 = a
    train batch's grad-accumulation axis (A, B, ...), 0 = an eval batch (B, ...), 2 = a chunk of
    train batches for ``train.step.make_train_steps`` (K, A, B, ...)."""
    return NamedSharding(mesh, P(*[None] * int(lead), BATCH))


def check_batch_divides(mesh: Mesh, rows: int, what: str = "micro-batch") -> None:
    n = batch_devices(mesh.shape)
    if rows % n:
        raise ValueError(f"{what} of {rows} rows does not split over data*fsdp*expert={n} devices; "
                         f"use a multiple of {n} (batch_size / grad_accum)")


def shard_batch(batch: dict, mesh: Mesh, lead: int = 1) -> dict:
    """A host batch (NumPy, the GLOBAL batch, identical on every process) -> global jax.Arrays with
    rows (axis ``lead``, as ``batch_sharding``) split over ('data', 'fsdp', 'expert'). Each process
    hands over only the rows its own devices hold (jax.make_array_from_process_local_data), so
    multi-host runs feed each process its shard."""
    sharding = batch_sharding(mesh, lead)
    axis = int(lead)

    def put(x):
        x = np.asarray(x)
        check_batch_divides(mesh, x.shape[axis])
        idx = sharding.addressable_devices_indices_map(x.shape).values()
        lo = min(i[axis].start or 0 for i in idx)
        hi = max(x.shape[axis] if i[axis].stop is None else i[axis].stop for i in idx)
        local = np.take(x, np.arange(lo, hi), axis=axis)  # (..., rows of this process, ...)
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    return jax.tree.map(put, batch)


@contextlib.contextmanager
def constrain_activations(mesh: Mesh, rows: int):
    """Context manager (flax ``nn.intercept_methods``): every module output of shape (rows, ...)
    is constrained to rows over ('data', 'fsdp', 'expert'), the rest replicated or left to propagation.
    It also makes ``mesh`` the ambient (abstract) mesh of the trace, where MoE's 'alltoall' dispatch
    finds its 'expert' axis (jaxgpt/nn/moe_dispatch.py); ``jax.set_mesh`` cannot be entered inside jit.

    This is the activation half of the logical-axis rules, applied from outside the model code.
    Without it XLA may keep the weights' 'fsdp' split and move the batch instead (gather the
    batch, split activations along d_model); with it, FSDP weights are all-gathered one layer at a
    time inside the layer scan, as in ZeRO-3. A constraint changes placement, never values, so a
    (T, ...) table that happens to have ``rows`` rows is merely placed differently.
    """
    spec = NamedSharding(mesh, P(BATCH))

    def constrain(x):
        if isinstance(x, jax.Array) and x.ndim >= 2 and x.shape[0] == rows:
            return jax.lax.with_sharding_constraint(x, spec)
        return x

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        return jax.tree.map(constrain, out) if context.method_name == "__call__" else out

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.intercept_methods(interceptor):
        yield


def gathers_in_scan(hlo: str) -> bool:
    """True when a while-loop body of compiled HLO text (``jit(f).lower(...).compile().as_text()``)
    all-gathers: FSDP weights gathered one layer at a time inside the layer scan, not all up front."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)  # one block per computation
    return any(re.match(rf"%?{re.escape(b)}\b", blk) and "all-gather" in blk for blk in blocks for b in bodies)


def bytes_per_device(tree) -> dict[str, int]:
    """{device: bytes of ``tree``'s shards on it}, from ``addressable_shards``."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[str(s.device)] = out.get(str(s.device), 0) + s.data.nbytes
    return out


def describe(config, params, mesh: Mesh) -> dict[str, str]:
    """{'layers/attn/q_proj/kernel': "P(None, 'fsdp', 'tensor')", ...}: the placement, for logs and docs."""
    specs = param_specs(config, params, mesh)
    return {"/".join(_names(p)): str(s) for p, s in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))}


__all__ = ["AXES", "LOGICAL_RULES", "PARAM_RULES", "batch_sharding", "bytes_per_device", "constrain_activations",
           "describe", "gathers_in_scan", "mesh_devices", "ReplicationWarning", "replication_message", "unsplit",
           "logical_axes", "make_mesh", "param_shardings", "param_specs", "parse_mesh", "shard_batch",
           "state_shardings", "use_host_devices", "auto_mesh"]
