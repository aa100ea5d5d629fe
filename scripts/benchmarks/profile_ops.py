"""The op-level half of scripts/benchmarks/profile_step.py: the profile's categories, the jaxgpt ops
classified from the optimised HLO (``scripts.harness.parse_hlo``) and timed from an xplane, the torch
ops classified by aten name and phase, and the per-op summaries."""
from __future__ import annotations

import collections
import re

from scripts.harness import hlo_dims

CATEGORIES = ("matmul fwd", "matmul bwd", "attention core", "elementwise", "layout copy/transpose",
              "reductions", "optimizer + clip", "other")

# ---------------------------------------------------------------- jaxgpt: optimised HLO

_MOVE = {"copy", "transpose", "bitcast", "reshape", "slice", "concatenate", "pad", "dynamic-slice",
         "dynamic-update-slice", "parameter", "constant", "tuple", "get-tuple-element", "broadcast",
         "reverse", "iota", "bitcast-convert"}


def _by_comp(instrs: dict) -> dict:
    out = collections.defaultdict(list)
    for name, ins in instrs.items():
        out[ins["comp"]].append(name)
    return out


def _dot_flops(instrs: dict, name: str) -> tuple[float, bool]:
    """(FLOPs of a dot, has batch dims)."""
    ins = instrs[name]
    out = 1
    for d in hlo_dims(ins["shape"]):
        out *= d
    lhs = hlo_dims(instrs[ins["args"][0]]["shape"]) if ins["args"] and ins["args"][0] in instrs else []
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins["attrs"])
    k = 1
    for i in (int(x) for x in (m.group(1).split(",") if m and m.group(1) else [])):
        k *= lhs[i] if i < len(lhs) else 1
    return 2.0 * out * k, "lhs_batch_dims" in ins["attrs"]


def classify_hlo(instrs: dict) -> dict:
    """Top-level op name -> {kind, phase, flops, batched}: kind in matmul / elementwise / layout /
    reduction / gather / container / other; phase fwd / bwd / opt."""
    comps = _by_comp(instrs)

    def contents(comp: str, seen=None) -> list[str]:
        seen = set() if seen is None else seen
        if comp in seen:
            return []
        seen.add(comp)
        names = list(comps.get(comp, []))
        for n in list(names):
            for c in instrs[n]["calls"]:
                names += contents(c, seen)
        return names

    out = {}
    for name, ins in instrs.items():
        op = ins["op"]
        inner = [name] if op != "fusion" else contents(ins["calls"][0]) if ins["calls"] else []
        ops = {instrs[n]["op"] for n in inner}
        flops, batched = 0.0, False
        for n in inner:
            if instrs[n]["op"] == "dot":
                f, b = _dot_flops(instrs, n)
                flops += f
                batched |= b
        if op in ("while", "call", "conditional"):
            kind = "container"
        elif "dot" in ops or "convolution" in ops or (op == "custom-call" and "matmul" in ins["attrs"].lower()):
            kind = "matmul"
        elif ops & {"reduce", "reduce-window", "all-reduce"}:
            kind = "reduction"
        elif ops & {"gather", "scatter"}:
            kind = "gather"
        elif ops <= _MOVE and ops & {"copy", "transpose", "concatenate", "pad", "slice", "dynamic-slice",
                                     "dynamic-update-slice", "reverse"}:
            kind = "layout"
        elif op in ("copy", "transpose", "copy-start", "copy-done"):
            kind = "layout"
        else:
            kind = "elementwise"
        if kind == "elementwise" and ops <= {"broadcast", "constant", "parameter", "bitcast", "iota"}:
            kind = "fill"  # buffers a scan writes its stacked results into, zero-initialised
        out[name] = {"kind": kind, "phase": _phase(ins["op_name"]), "flops": flops, "batched": batched}
    # ops inside a while body (the scanned layers) take the phase of the while that runs them
    caller = {c: n for n, ins in instrs.items() if ins["op"] in ("while", "call", "conditional") for c in ins["calls"]}
    for name, ins in instrs.items():
        if _phase(ins["op_name"]) is None:
            c, seen = ins["comp"], set()
            while c in caller and c not in seen and _phase(instrs[caller[c]]["op_name"]) is None:
                seen.add(c)
                c = instrs[caller[c]]["comp"]
            w = caller.get(c)
            p = _phase(instrs[w]["op_name"]) if w else None
            out[name]["phase"] = p or ("opt" if ins["op_name"].startswith("jit(") else "fwd")
    return out


def _phase(op_name: str):
    """bwd / fwd / opt from an op's metadata op_name; None when it does not say (scan bodies, no metadata)."""
    if "transpose(jvp(" in op_name:
        return "bwd"
    if "jvp(" in op_name:
        return "fwd"
    if op_name.startswith("jit(") and "layers.body" not in op_name:
        return "opt"
    return None


def jax_category(info: dict) -> str:
    kind, phase = info["kind"], info["phase"]
    if kind == "fill":
        return "other"
    if phase == "opt":
        return "optimizer + clip"
    if kind == "matmul":
        return "attention core" if info["batched"] else f"matmul {phase}"
    return {"elementwise": "elementwise", "layout": "layout copy/transpose", "reduction": "reductions"}.get(kind, "other")


def thunk_self_times(xspace_path: str, module: str = "train_step") -> dict:
    """{(hlo_op, step): [self ns, executions]} from an xplane; step = the index of the enclosing
    ``pstep{i}`` TraceAnnotation (-1 outside every one). Nested thunks (while bodies): a parent's
    self time excludes its children."""
    import jax
    pd = jax.profiler.ProfileData.from_file(xspace_path)
    steps, lines = [], []
    for plane in pd.planes:
        for line in plane.lines:
            evs = []
            for e in line.events:
                m = re.fullmatch(r"pstep(\d+)", e.name)
                if m:
                    steps.append((e.start_ns, e.end_ns, int(m.group(1))))
                    continue
                stats = dict(e.stats)
                if "hlo_op" in stats and module in str(stats.get("hlo_module", "")):
                    evs.append((e.start_ns, e.end_ns, stats["hlo_op"]))
            lines.append(sorted(evs))
    per = collections.defaultdict(lambda: [0.0, 0])
    for evs in lines:
        stack = []
        for s, e, op in evs:
            step = next((i for a, b, i in steps if a <= s < b), -1)
            while stack and stack[-1][1] <= s:
                stack.pop()
            if stack:
                per[stack[-1][2]][0] -= e - s
            per[(op, step)][0] += e - s
            per[(op, step)][1] += 1
            stack.append((s, e, (op, step)))
    return dict(per)


def per_op_summary(per: dict, steps: int) -> dict:
    """op -> {mean_ms, best_ms, n}: mean over the profiled steps, and the best (least disturbed) step's
    time of that op; n = executions per step."""
    by = collections.defaultdict(dict)
    for (op, step), (ns, n) in per.items():
        by[op][step] = (ns, n)
    out = {}
    for op, d in by.items():
        vals = [d.get(i, (0.0, 0)) for i in range(steps)]
        extra = d.get(-1, (0.0, 0))
        out[op] = {"mean_ms": (sum(v[0] for v in vals) + extra[0]) / 1e6 / steps,
                   "best_ms": min(v[0] for v in vals) / 1e6 if steps else 0.0,
                   "n": max(v[1] for v in vals) if vals else 0}
    return out


def summarise(per_op: dict, category_of) -> dict:
    cats = {c: 0.0 for c in CATEGORIES}
    best = {c: 0.0 for c in CATEGORIES}
    counts = {c: 0 for c in CATEGORIES}
    ops = []
    for op, v in per_op.items():
        c = category_of(op)
        cats[c] += v["mean_ms"]
        best[c] += v["best_ms"]
        counts[c] += v["n"]
        ops.append((v["mean_ms"], op, c))
    ops.sort(reverse=True)
    return {"categories_ms": cats, "categories_best_ms": best, "op_counts": counts,
            "top_ops": [{"op": str(o), "ms": round(ms, 3), "category": c} for ms, o, c in ops[:25]]}


# ---------------------------------------------------------------- torch: aten ops

_TORCH_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
_TORCH_ATTN = ("scaled_dot_product", "flash_attention")
_TORCH_LAYOUT = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to", "aten::cat",
                 "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t", "aten::permute",
                 "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
                 "aten::_unsafe_view", "aten::split", "aten::narrow", "aten::detach", "aten::alias", "aten::flatten",
                 "aten::unflatten", "aten::empty_like", "aten::empty", "aten::empty_strided", "aten::zeros",
                 "aten::zero_", "aten::fill_", "aten::resize_", "aten::expand_as", "aten::stack", "aten::chunk",
                 "aten::unbind", "aten::lift_fresh", "aten::numpy_T", "aten::new_empty_strided"}
_TORCH_REDUCE = ("layer_norm", "softmax", "nll_loss", "cross_entropy", "aten::sum", "aten::mean", "aten::argmax",
                 "norm", "aten::max", "aten::amax", "aten::var", "aten::rms")
_TORCH_OTHER = ("embedding", "index_select", "index_add", "index", "gather", "scatter", "aten::item",
                "aten::_local_scalar_dense", "aten::arange", "aten::randn")


def torch_category(name: str, phase: str) -> str:
    if phase in ("clip", "opt"):
        return "optimizer + clip"
    if not name.startswith("aten::"):
        return "other"  # autograd engine nodes, record_function labels: framework overhead
    if name in _TORCH_MATMUL:
        return f"matmul {phase}"
    if any(s in name for s in _TORCH_ATTN):
        return "attention core"
    if name in _TORCH_LAYOUT:
        return "layout copy/transpose"
    if any(s in name for s in _TORCH_REDUCE):
        return "reductions"
    if any(s in name for s in _TORCH_OTHER):
        return "other"
    return "elementwise"
