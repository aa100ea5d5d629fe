"""Profile ONE train step per op, jaxgpt against torch eager, and group the time into categories.

    .venv/bin/python scripts/profile_step.py                    # cpu-small + shakespeare-char -> results/engine/profile.{json,md}
    .venv/bin/python scripts/profile_step.py --quick --out /tmp/p.json   # CI smoke: tiny shape, seconds
    .venv/bin/python scripts/profile_step.py --shapes cpu-small --settings jaxgpt-default,jaxgpt-unrolled
    .venv/bin/python scripts/profile_step.py --variants --variant-rounds 3 \
        --variant-names gelu-erf,fused-qkv,gelu-erf+fused-qkv,headmajor   # + A/B: library step vs prototypes
    .venv/bin/python scripts/profile_step.py --shapes cpu-small --threads 1 --out /tmp/p1.json  # 1 thread each
    .venv/bin/python scripts/profile_step.py --markdown-only    # rewrite profile.md from profile.json

Default time budget on the shared 2-core CPU: about 4 min for cpu-small and 15 min for shakespeare-char
under a load average of 10 (about 5 min in all on an idle machine), plus about 12 min for --variants.

Same shapes, batches, optimizer and float32 as scripts/bench_train.py (its SHAPES and JAX_SETTINGS).
Every (framework, setting) runs in its own subprocess (thread pools of two frameworks interfere):
  jaxgpt: the compiled ``make_train_step`` runs under ``jax.profiler.trace``; the xplane is read back with
          ``jax.profiler.ProfileData`` (one event per executed XLA thunk, with its ``hlo_op``). Each op is
          classified from the optimised HLO (``compiled.as_text()``): what its fusion contains (dot,
          reduce, only data movement, gather/scatter, other elementwise) and its metadata op_name:
          ``transpose(jvp(...))`` = backward, ``jvp(...)`` = forward, anything else = the optimizer
          (clipping, AdamW, the loss scaling). Times are thunk self times summed over threads.
  torch:  torch_ref's training step (same code as torch_ref.train.train_step, with record_function
          labels around forward / backward / clip / optimizer) under ``torch.profiler``; every event's
          self CPU time is classified by aten op name and by the phase it runs in.
Each op's time is reported as the mean over the profiled steps and as its best step (least disturbed
by other jobs on a loaded machine); the tables' shares are what to compare, not absolute ms under load.
Categories: matmul (projections, lm head) forward / backward, attention core (jaxgpt: the batched
score/mix dots; torch: the fused SDPA kernel, forward + backward), elementwise, layout copies /
transposes (torch: also view ops), reductions (softmax, norms, loss), optimizer + clip, other
(embedding gather/scatter, framework overhead). The matmul time is compared with its FLOP-count
lower bound at the float32 matmul peak measured in the same process (best of 5 2048^3 matmuls) and
at the idle machine's peak recorded by bench_train.py (results/engine/bench_train.json).
Also reported: the step time without the profiler (median of ``--time-steps`` steps), and the op
count per category. ``--variants`` races prototype variants of the jaxgpt step (code in this file,
library untouched) against the library step in alternating subprocesses and checks their numerics.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_train as bt  # noqa: E402  (SHAPES, JAX_SETTINGS, batches, FLOP estimate; imports no framework)

CATEGORIES = ("matmul fwd", "matmul bwd", "attention core", "elementwise", "layout copy/transpose",
              "reductions", "optimizer + clip", "other")
DEFAULT_SETTINGS = ("jaxgpt-default", "jaxgpt-unrolled")
# profiled steps per process (the categories are averaged over them) and unprofiled timed steps; every
# process first runs WARMUP[shape] untimed steps
STEPS = {"cpu-small": (8, 10), "shakespeare-char": (1, 1), "quick": (2, 2)}
WARMUP = {"cpu-small": 2, "shakespeare-char": 1, "quick": 2}


# ---------------------------------------------------------------- optimised-HLO parsing (jax)

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_MOVE = {"copy", "transpose", "bitcast", "reshape", "slice", "concatenate", "pad", "dynamic-slice",
         "dynamic-update-slice", "parameter", "constant", "tuple", "get-tuple-element", "broadcast",
         "reverse", "iota", "bitcast-convert"}


def _dims(shape: str) -> list[int]:
    m = re.match(r"\(?\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _split_args(rest: str) -> tuple[str, str]:
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse_hlo(text: str) -> dict:
    """name -> {op, shape, args, comp, calls, op_name, attrs} for every instruction of the module."""
    instrs, comp = {}, None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            name, shape, op, rest = m.groups()
            args, attrs = _split_args(rest)
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", attrs)
            calls += re.findall(r"called_computations=\{([^}]*)\}", attrs)
            opn = re.search(r'op_name="([^"]*)"', attrs)
            instrs[name] = {"op": op, "shape": shape, "args": re.findall(r"%([\w.\-]+)", args), "comp": comp,
                            "calls": [c.strip().lstrip("%") for c in ",".join(calls).split(",") if c.strip()],
                            "op_name": opn.group(1) if opn else "", "attrs": attrs}
            continue
        m = _COMP.match(line)
        if m:
            comp = m.group(2)
    return instrs


def _by_comp(instrs: dict) -> dict:
    out = collections.defaultdict(list)
    for name, ins in instrs.items():
        out[ins["comp"]].append(name)
    return out


def _dot_flops(instrs: dict, name: str) -> tuple[float, bool]:
    """(FLOPs of a dot, has batch dims)."""
    ins = instrs[name]
    out = 1
    for d in _dims(ins["shape"]):
        out *= d
    lhs = _dims(instrs[ins["args"][0]]["shape"]) if ins["args"] and ins["args"][0] in instrs else []
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


# ---------------------------------------------------------------- workers (one per subprocess)

def _peak_jax(n: int) -> float:
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    return 2 * n ** 3 / bt._best_of(lambda: mm(a, a).block_until_ready()) / 1e9


def _peak_torch(n: int) -> float:
    import torch
    a = torch.randn(n, n)
    a @ a
    return 2 * n ** 3 / bt._best_of(lambda: a @ a) / 1e9


def _jax_state(shape: str, setting: str, variant: str | None = None):
    config, batch, seq_len, _ = bt.SHAPES[shape]
    chosen = json.loads(setting) if setting.startswith("{") else bt.JAX_SETTINGS[setting]
    devices = chosen.get("host_devices", 1)
    from jaxgpt.parallel.sharding import use_host_devices
    use_host_devices(devices)
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxgpt.config import TrainConfig
    from jaxgpt.train.step import init_state, make_train_step
    if variant:
        apply_variant(variant)
    config = config.replace(**chosen.get("config", {}))
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=1000)
    state = init_state(config, tc)
    return config, tc, state, devices, jax, Mesh, NamedSharding, P, make_train_step


def _worker_jax(shape: str, setting: str, steps: int, time_steps: int, peak_n: int) -> dict:
    config, tc, state, devices, jax, Mesh, NamedSharding, P, make_train_step = _jax_state(shape, setting)
    warm = WARMUP[shape]
    batches = bt._batches(config, tc.batch_size, tc.seq_len, warm + time_steps + steps)
    if devices > 1:
        mesh = Mesh(jax.devices()[:devices], ("data",))
        state = jax.device_put(state, NamedSharding(mesh, P()))
        batches = [jax.device_put(b, NamedSharding(mesh, P(None, "data"))) for b in batches]
    else:
        batches = [jax.device_put(b) for b in batches]
    peak = _peak_jax(peak_n)
    compiled = make_train_step(config, tc).lower(state, batches[0]).compile()
    info = classify_hlo(parse_hlo(compiled.as_text()))
    times = []
    for i, b in enumerate(batches[:warm + time_steps]):
        t = time.perf_counter()
        state, metrics = compiled(state, b)
        jax.block_until_ready(metrics)
        if i >= warm:
            times.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for i, b in enumerate(batches[warm + time_steps:]):
                with jax.profiler.TraceAnnotation(f"pstep{i}"):
                    state, metrics = compiled(state, b)
                    jax.block_until_ready(metrics)
        wall = (time.perf_counter() - t) / steps
        path = next(Path(d).rglob("*.xplane.pb"))
        per_op = per_op_summary(thunk_self_times(str(path)), steps)
    unknown = {"kind": "other", "phase": "opt", "flops": 0.0, "batched": False}
    summary = summarise(per_op, lambda op: jax_category(info.get(op, unknown)))
    kinds = collections.Counter()
    matmul_flops = {"projection": 0.0, "attention": 0.0}
    for op, v in per_op.items():
        i = info.get(op, unknown)
        kinds[i["kind"] + "/" + i["phase"]] += v["mean_ms"]
        if i["kind"] == "matmul":  # FLOPs of the dots that ran, times how often per step
            matmul_flops["attention" if i["batched"] else "projection"] += i["flops"] * v["n"]
    return {"framework": "jax", "jax_version": jax.__version__, "setting": setting, **summary,
            "kinds_ms": dict(kinds), "profiled_wall_ms": 1e3 * wall, "step_ms": 1e3 * statistics.median(times),
            "matmul_flops": matmul_flops, "peak_gflops": peak, "loss": float(metrics["loss"]),
            "n_ops": sum(v["n"] for v in per_op.values())}


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


def _torch_step(model, opt, sched, tc, batch, record):
    """torch_ref.train.train_step (grad_accum 1), with record_function labels per phase."""
    import torch
    from torch.profiler import record_function

    from torch_ref.train import loss_terms
    ctx = record_function if record else (lambda name: __import__("contextlib").nullcontext())
    model.train()
    opt.zero_grad(set_to_none=True)
    with ctx("phase:fwd"):
        terms = loss_terms(model, {k: v[0] for k, v in batch.items()})
    with ctx("phase:bwd"):
        terms["loss_sum"].backward()
    count = max(terms["count"].item(), 1)
    with ctx("phase:clip"):
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= count
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    with ctx("phase:opt"):
        opt.step()
        sched.step()
    return terms["loss_sum"].item() / count


def _worker_torch(shape: str, steps: int, time_steps: int, peak_n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import torch_ref
    from jaxgpt.config import TrainConfig
    from torch_ref.train import make_optimizer, train_step
    config, batch, seq_len, _ = bt.SHAPES[shape]
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=1000)
    torch.manual_seed(0)
    model = torch_ref.build(config).float()
    opt, sched = make_optimizer(model, tc)
    warm = WARMUP[shape]
    batches = bt._batches(config, batch, seq_len, warm + time_steps + steps)
    peak = _peak_torch(peak_n)
    times = []
    for i, b in enumerate(batches[:warm + time_steps]):
        t = time.perf_counter()
        train_step(model, opt, sched, tc, b)  # the library's step, unprofiled
        if i >= warm:
            times.append(time.perf_counter() - t)
    t = time.perf_counter()
    from torch.profiler import record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, b in enumerate(batches[warm + time_steps:]):
            with record_function(f"pstep{i}"):
                loss = _torch_step(model, opt, sched, tc, b, record=True)
    wall = (time.perf_counter() - t) / steps
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        phase, step, p = None, -1, ev
        while p is not None:
            if phase is None and p.name.startswith("phase:"):
                phase = p.name[6:]
            elif phase is None and p.name.startswith("autograd::engine"):
                phase = "bwd"
            elif phase is None and p.name.startswith("Optimizer.step"):
                phase = "opt"
            m = re.fullmatch(r"pstep(\d+)", p.name)
            if m:
                step = int(m.group(1))
                break
            p = p.cpu_parent
        if ev.name.startswith(("phase:", "pstep")):
            phase = phase or "fwd"
        key = (ev.name, torch_category(ev.name, phase or "fwd"))
        per[(key, step)][0] += 1e3 * ev.self_cpu_time_total  # us -> ns
        per[(key, step)][1] += 1
    per_op = per_op_summary(per, steps)
    summary = summarise(per_op, lambda key: key[1])
    for o in summary["top_ops"]:
        o["op"] = o["op"].split("'")[1] if o["op"].startswith("(") else o["op"]
    return {"framework": "torch", "torch_version": torch.__version__, "threads": torch.get_num_threads(), **summary,
            "profiled_wall_ms": 1e3 * wall, "step_ms": 1e3 * statistics.median(times), "peak_gflops": peak,
            "loss": loss, "n_params": sum(p.numel() for p in model.parameters()),
            "n_ops": sum(v["n"] for v in per_op.values())}


# ---------------------------------------------------------------- variants (prototypes, library untouched)

VARIANTS = {
    "headmajor": "q/k/v projected by einsum straight to (B, H, T, D) (kernels viewed as (d, H, D)), attention "
                 "core on head-major tensors, o_proj by einsum from (B, H, T, D): no token/head-major copies",
    "fused-qkv": "q, k, v kernels concatenated into one (d, 3 d) matmul (split views of the same params)",
    "gelu-erf": "exact GELU written with erf, 0.5 x (1 + erf(x / sqrt 2)), instead of jax.nn.gelu(approximate=False) "
                "(erfc, which XLA:CPU expands into exp + selects)",
}


def apply_variant(name: str) -> None:
    """Monkeypatch jaxgpt in THIS process with the prototypes named in ``name`` ('+'-joined VARIANTS
    keys). Attention variants replace Attention.__call__ (same params, same math) on the plain training
    path (no cache, no RoPE, no mask, no dropout); gelu-erf replaces jaxgpt.nn.mlp.ACTIVATIONS['gelu']."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.nn import attention as A
    from jaxgpt.nn import mlp
    parts = name.split("+")
    if "gelu-erf" in parts:
        mlp.ACTIVATIONS["gelu"] = lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * (2.0 ** -0.5)))
    name = next((p for p in parts if p in ("headmajor", "fused-qkv")), None)
    if name is None:
        return
    orig = A.Attention.__call__

    def call(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
             return_weights=False, deterministic=True):
        plain = (context is None and mask is None and cache is None and not return_weights and not self.rope
                 and not self.qkv_bias and not self.o_bias and (deterministic or self.attn_dropout == 0.0)
                 and (self.n_kv_head or self.n_head) == self.n_head and self.attention_impl == "xla")
        if not plain:
            return orig(self, x, context, mask=mask, is_causal=is_causal, positions=positions, cache=cache,
                        return_weights=return_weights, deterministic=deterministic)
        h, d_model = self.n_head, self.d_model
        d = d_model // h
        b, t, _ = x.shape
        if self.is_initializing():
            return orig(self, x, context, mask=mask, is_causal=is_causal, positions=positions, cache=cache,
                        return_weights=return_weights, deterministic=deterministic)
        wq = self.variables["params"]["q_proj"]["kernel"]
        wk = self.variables["params"]["k_proj"]["kernel"]
        wv = self.variables["params"]["v_proj"]["kernel"]
        wo = self.variables["params"]["o_proj"]["kernel"]
        x2 = x.reshape(b * t, d_model)
        if name == "fused-qkv":
            qkv = x2 @ jnp.concatenate([wq, wk, wv], axis=1)  # (N, 3 d)
            q, k, v = (a.reshape(b, t, h, d) for a in jnp.split(qkv, 3, axis=1))
            out = A.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            y = out.reshape(b * t, d_model) @ wo
            return y.reshape(b, t, d_model), None, None
        # head-major
        xx = x
        q = jnp.einsum("btc,chd->bhtd", xx, wq.reshape(d_model, h, d))
        k = jnp.einsum("btc,chd->bhtd", xx, wk.reshape(d_model, h, d))
        v = jnp.einsum("btc,chd->bhtd", xx, wv.reshape(d_model, h, d))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
        if is_causal:
            s = jnp.where(A.causal_mask(t, t), s, jnp.finfo(jnp.float32).min)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", w.astype(v.dtype), v)
        y = jnp.einsum("bhtd,hdc->btc", o, wo.reshape(h, d, d_model))
        return y, None, None

    A.Attention.__call__ = call


def _worker_variant(shape: str, setting: str, variant: str, steps: int) -> dict:
    """Time ``steps`` steps of the jaxgpt step (variant 'library' = unpatched); return the step times,
    the loss and grad-norm trajectory and the final params' checksum (for identical numerics)."""
    config, tc, state, devices, jax, *_rest, make_train_step = _jax_state(
        shape, setting, None if variant == "library" else variant)
    import numpy as np
    batches = [jax.device_put(b) for b in bt._batches(config, tc.batch_size, tc.seq_len, steps + 2)]
    compiled = make_train_step(config, tc).lower(state, batches[0]).compile()
    times, losses = [], []
    for i, b in enumerate(batches):
        t = time.perf_counter()
        state, m = compiled(state, b)
        jax.block_until_ready(m)
        if i >= 2:
            times.append(time.perf_counter() - t)
        losses.append([float(m["loss"]), float(m["grad_norm"])])
    flat = np.concatenate([np.asarray(a).ravel() for a in jax.tree.leaves(state.params)])
    return {"times_s": times, "losses": losses, "param_sum": float(np.abs(flat).sum()),
            "params_head": flat[:2000].tolist()}


def _single_thread() -> None:
    """One compute thread per framework (set before either initialises its pools)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import torch
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def _worker(args) -> None:
    if args.threads == 1:
        _single_thread()
    kind, _, setting = args.worker.partition(":")
    if kind == "jax":
        out = _worker_jax(args.shape, setting, args.steps, args.time_steps, args.peak_n)
    elif kind == "torch":
        out = _worker_torch(args.shape, args.steps, args.time_steps, args.peak_n)
    else:  # variant:<variant>:<setting>
        variant, _, setting = setting.partition(":")
        out = _worker_variant(args.shape, setting, variant, args.time_steps)
    print("RESULT " + json.dumps(out))


def _spawn(worker: str, shape: str, steps: int, time_steps: int, peak_n: int, timeout: float = 1800,
           threads: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, "--shape", shape, "--steps", str(steps),
           "--time-steps", str(time_steps), "--peak-n", str(peak_n), "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
    return {"error": f"{worker} exited with {p.returncode}: " + " | ".join(tail)}


# ---------------------------------------------------------------- driver

def matmul_bounds(shape: str, res: dict, quiet_peak: float | None = None) -> dict:
    """Matmul FLOPs per step and their time at the process's measured peak (the lower bound)."""
    config, batch, seq_len, _ = bt.SHAPES[shape]
    tokens = batch * seq_len
    out = {}
    for key, r in res.items():
        if "error" in r:
            continue
        if r["framework"] == "jax":
            proj, attn = r["matmul_flops"]["projection"], r["matmul_flops"]["attention"]
            source = "counted from the HLO dots that ran"
        else:
            n = r["n_params"] - (config.max_len * config.d_model if config.pos == "learned" else 0)
            proj, attn = 6 * n * tokens, 12 * config.n_layer * seq_len * config.d_model * tokens
            source = "nanoGPT estimate: 6 N tokens (projections, lm head) + 12 L T d tokens (attention)"
        peak = r["peak_gflops"] * 1e9
        c = r["categories_best_ms"]  # best step per op, like the best-of-5 peak
        mm = c["matmul fwd"] + c["matmul bwd"]
        out[key] = {"projection_gflop": proj / 1e9, "attention_gflop": attn / 1e9, "flops_source": source,
                    "peak_gflops": r["peak_gflops"], "projection_bound_ms": 1e3 * proj / peak,
                    "attention_bound_ms": 1e3 * attn / peak, "projection_ms": mm, "attention_ms": c["attention core"],
                    "projection_efficiency": (1e3 * proj / peak) / mm if mm else None,
                    "attention_efficiency": (1e3 * attn / peak) / c["attention core"] if c["attention core"] else None}
        if quiet_peak:
            out[key].update(quiet_peak_gflops=quiet_peak, projection_bound_quiet_ms=1e3 * proj / (quiet_peak * 1e9),
                            attention_bound_quiet_ms=1e3 * attn / (quiet_peak * 1e9))
    return out


def markdown(result: dict) -> str:
    lines = ["# Per-op profile of one train step, jaxgpt against torch eager (scripts/profile_step.py)", "",
             "Reading, caveats and conclusion: docs/performance.md, section 'Profile: where the time goes'. "
             "A load average above 2 means other jobs shared the 2 cores: compare shares, not absolute ms.", "",
             f"Machine: {result['machine']}; load average {result['load_average']['start']:.1f} at start, "
             f"{result['load_average']['end']:.1f} at end. Category cells: ms per train step, mean over the profiled "
             f"steps / sum over ops of each op's best step (least disturbed by other load), and ops per step; "
             f"jaxgpt: XLA thunk self times summed over threads; torch: self CPU time of every profiler event "
             f"(aten ops; 'other' includes autograd-engine and Python-side events).", ""]
    sections = [(shape, s, "") for shape, s in result["shapes"].items()]
    sections += [(shape, s, ", one compute thread per framework (--threads 1)")
                 for shape, s in result.get("single_thread", {}).items()]
    for shape, s, note in sections:
        res = s["runs"]
        keys = [k for k in res if "error" not in res[k]]
        lines += [f"**{shape}** ({s['profiled_steps']} profiled step(s) per process{note})", "",
                  "| category | " + " | ".join(f"{k} ms mean / best" for k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for c in CATEGORIES:
            cells = [f"{res[k]['categories_ms'][c]:.2f} / {res[k]['categories_best_ms'][c]:.2f} "
                     f"({res[k]['op_counts'][c]} ops)" for k in keys]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("| **sum of op times** | " + " | ".join(
            f"**{sum(res[k]['categories_ms'].values()):.2f} / {sum(res[k]['categories_best_ms'].values()):.2f}**"
            for k in keys) + " |")
        lines.append("| step wall, profiled | " + " | ".join(f"{res[k]['profiled_wall_ms']:.2f}" for k in keys) + " |")
        lines.append("| step wall, no profiler (median) | " + " | ".join(f"{res[k]['step_ms']:.2f}" for k in keys) + " |")
        lines.append("")
        lines += ["| matmul vs FLOP lower bound | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        b = s["matmul_bounds"]
        lines.append("| projections + lm head: GFLOP, bound ms, measured ms, efficiency | " + " | ".join(
            f"{b[k]['projection_gflop']:.2f}, {b[k]['projection_bound_ms']:.2f}, {b[k]['projection_ms']:.2f}, "
            f"{100 * (b[k]['projection_efficiency'] or 0):.0f}%" for k in keys) + " |")
        lines.append("| attention core: GFLOP, bound ms, measured ms, efficiency | " + " | ".join(
            f"{b[k]['attention_gflop']:.2f}, {b[k]['attention_bound_ms']:.2f}, {b[k]['attention_ms']:.2f}, "
            f"{100 * (b[k]['attention_efficiency'] or 0):.0f}%" for k in keys) + " |")
        lines.append("| matmul peak in the process, GFLOP/s | " + " | ".join(f"{b[k]['peak_gflops']:.0f}" for k in keys) + " |")
        if all("quiet_peak_gflops" in b[k] for k in keys):
            q = b[keys[0]]["quiet_peak_gflops"]
            lines.append(f"| bound at the idle machine's peak ({q:.0f} GFLOP/s): projections, attention ms | " +
                         " | ".join(f"{b[k]['projection_bound_quiet_ms']:.2f}, {b[k]['attention_bound_quiet_ms']:.2f}"
                                    for k in keys) + " |")
        lines.append("")
        for k in keys:
            top = ", ".join(f"{o['op']} {o['ms']:.2f} ({o['category']})" for o in res[k]["top_ops"][:8])
            lines.append(f"- {k} top ops: {top}")
        for k in res:
            if "error" in res[k]:
                lines.append(f"- {k}: failed: {res[k]['error'][:200]}")
        lines.append("")
    for shape, v in result.get("variants", {}).items():
        lines += [f"**Variants, {shape}** (setting {v['setting']}; {v['rounds']} alternating rounds, "
                  f"median ms/step over all rounds' steps)", "",
                  "| variant | ms/step | vs library | max abs loss diff | params max abs diff (first 2000) |",
                  "|---|---|---|---|---|"]
        for name, row in v["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | failed: {row['error'][:100]} | | | |")
                continue
            lines.append(f"| {name} | {row['ms_step']:.2f} | {row['speedup']:.2f}x | {row['loss_diff']:.2e} | "
                         f"{row['param_diff']:.2e} |")
        lines.append("")
    return "\n".join(lines)


def run_variants(shape: str, setting: str, rounds: int, time_steps: int, variants=tuple(VARIANTS)) -> dict:
    names = ("library",) + tuple(variants)
    per = {n: [] for n in names}
    for i in range(rounds):
        for n in (names if i % 2 == 0 else names[::-1]):
            out = _spawn(f"variant:{n}:{setting}", shape, 1, time_steps, 256)
            per[n].append(out)
            msg = out.get("error") or f"median {1e3 * statistics.median(out['times_s']):.1f} ms"
            print(f"  variants {shape} round {i + 1}/{rounds} {n}: {msg}", file=sys.stderr, flush=True)
    rows = {}
    ref = next((o for o in per["library"] if "error" not in o), None)
    for n, outs in per.items():
        ok = [o for o in outs if "error" not in o]
        if not ok or ref is None:
            rows[n] = {"error": (outs[0] if outs else {}).get("error", "library run failed")}
            continue
        ms = 1e3 * statistics.median(t for o in ok for t in o["times_s"])
        rows[n] = {"ms_step": ms, "round_medians_ms": [1e3 * statistics.median(o["times_s"]) for o in ok],
                   "loss_diff": max(abs(a[0] - b[0]) for a, b in zip(ok[0]["losses"], ref["losses"])),
                   "param_diff": max(abs(a - b) for a, b in zip(ok[0]["params_head"], ref["params_head"])),
                   "description": " + ".join(VARIANTS.get(p, "jaxgpt.train.step.make_train_step as is")
                                              for p in n.split("+"))}
    base = rows["library"].get("ms_step")
    for r in rows.values():
        if base and "ms_step" in r:
            r["speedup"] = base / r["ms_step"]
    return {"setting": setting, "rounds": rounds, "steps_per_process": time_steps, "rows": rows}


def _quiet_peak() -> float | None:
    """The best float32 matmul peak scripts/bench_train.py recorded (results/engine/bench_train.json: one
    result, or one per shape), None if there is none."""
    bench = ROOT / "results" / "engine" / "bench_train.json"
    if not bench.exists():
        return None
    r = json.loads(bench.read_text())
    peaks = [r["peak"]] if "peak" in r else [v["peak"] for v in r.values() if isinstance(v, dict) and "peak" in v]
    return max(peaks) if peaks else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cpu-small,shakespeare-char")
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"jaxgpt settings of {sorted(bt.JAX_SETTINGS)}")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI smoke: the tiny shape, default setting + torch")
    ap.add_argument("--variants", action="store_true", help="also race the prototype variants (cpu-small only)")
    ap.add_argument("--variant-setting", default="jaxgpt-unrolled")
    ap.add_argument("--variant-rounds", type=int, default=4)
    ap.add_argument("--variant-names", default=",".join(VARIANTS), help=f"'+' combines; of {sorted(VARIANTS)}")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, choices=(0, 1),
                    help="1: one compute thread per framework (torch.set_num_threads(1), XLA without its Eigen "
                         "pool): per-op work, less disturbed by a loaded machine; 0: each framework's default")
    ap.add_argument("--quiet-peak", type=float, default=None,
                    help="float32 matmul peak GFLOP/s of the idle machine for the matmul lower bound (default: "
                         "results/engine/bench_train.json's, if there)")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md (and bounds) from --out's JSON")
    ap.add_argument("--out", default=str(ROOT / "results" / "engine" / "profile.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="quick", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--time-steps", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    shapes = ["quick"] if args.quick else [] if args.shapes == "none" else args.shapes.split(",")
    if args.quiet_peak is None and not args.quick:
        args.quiet_peak = _quiet_peak()
    if args.markdown_only:  # re-derive the bounds and the table from an existing --out JSON
        result = json.loads(Path(args.out).read_text())
        for shape, s in list(result["shapes"].items()) + list(result.get("single_thread", {}).items()):
            s["matmul_bounds"] = matmul_bounds(shape, s["runs"], args.quiet_peak)
        Path(args.out).write_text(json.dumps(result, indent=1))
        Path(args.out).with_suffix(".md").write_text(markdown(result) + "\n")
        return result
    settings = ["jaxgpt-default"] if args.quick else args.settings.split(",")
    peak_n = 256 if args.quick else args.peak_n
    load_start = os.getloadavg()[0]
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "categories": CATEGORIES, "shapes": {}}
    for shape in shapes:
        steps, time_steps = STEPS[shape]
        runs = {}
        for s in settings:
            print(f"  {shape} {s} ...", file=sys.stderr, flush=True)
            runs[s] = _spawn(f"jax:{s}", shape, steps, time_steps, peak_n, threads=args.threads)
        if not args.no_torch:
            print(f"  {shape} torch-eager ...", file=sys.stderr, flush=True)
            runs["torch-eager"] = _spawn("torch:eager", shape, steps, time_steps, peak_n, threads=args.threads)
        result["shapes"][shape] = {"profiled_steps": steps, "threads": args.threads or "default", "runs": runs,
                                   "matmul_bounds": matmul_bounds(shape, runs, args.quiet_peak)}
    if args.variants:
        shape = "quick" if args.quick else "cpu-small"
        result["variants"] = {shape: run_variants(shape, args.variant_setting, 1 if args.quick else args.variant_rounds,
                                                  3 if args.quick else 15, args.variant_names.split(","))}
    result["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return result


if __name__ == "__main__":
    main()
