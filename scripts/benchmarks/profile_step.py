"""Profile ONE train step per op, jaxgpt against torch eager, and group the time into categories.

    .venv/bin/python -m scripts.benchmarks.profile_step                    # cpu-small + shakespeare-char -> results/engine/profile.{json,md}
    .venv/bin/python -m scripts.benchmarks.profile_step --quick --out /tmp/p.json   # CI smoke: tiny shape, seconds
    .venv/bin/python -m scripts.benchmarks.profile_step --shapes cpu-small --settings jaxgpt-default,jaxgpt-unrolled
    .venv/bin/python -m scripts.benchmarks.profile_step --variants --variant-rounds 3 \
        --variant-names gelu-erf,fused-qkv,gelu-erf+fused-qkv,headmajor   # + A/B: library step vs prototypes
    .venv/bin/python -m scripts.benchmarks.profile_step --shapes cpu-small --threads 1 --out /tmp/p1.json  # 1 thread each
    .venv/bin/python -m scripts.benchmarks.profile_step --markdown-only    # rewrite profile.md from profile.json

Default time budget on the shared 2-core CPU: about 4 min for cpu-small and 15 min for shakespeare-char
under a load average of 10 (about 5 min in all on an idle machine), plus about 12 min for --variants.

Same shapes, batches, optimizer and float32 as bench_train.py (its SHAPES and JAX_SETTINGS).
Every (framework, setting) runs in its own subprocess (profile_workers.py; thread pools of two frameworks
interfere):
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
count per category. ``--variants`` races prototype variants of the jaxgpt step (code in profile_workers.py,
library untouched) against the library step in alternating subprocesses and checks their numerics.
"""
from __future__ import annotations
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from scripts.benchmarks import bench_train as bt  # SHAPES, JAX_SETTINGS, FLOP estimate (imports no framework)
from scripts.benchmarks.profile_ops import CATEGORIES
from scripts.benchmarks.profile_workers import VARIANTS
from scripts.harness import RESULTS, load_average, spawn, write_result

DEFAULT_SETTINGS = ("jaxgpt-default", "jaxgpt-unrolled")
# profiled steps per process (the categories are averaged over them) and unprofiled timed steps
STEPS = {"cpu-small": (8, 10), "shakespeare-char": (1, 1), "quick": (2, 2)}


def _spawn(worker: str, shape: str, steps: int, time_steps: int, peak_n: int, timeout: float = 1800,
           threads: int = 0) -> dict:
    return spawn("scripts.benchmarks.profile_workers", "--worker", worker, "--shape", shape, "--steps", steps,
                 "--time-steps", time_steps, "--peak-n", peak_n, "--threads", threads, timeout=timeout)


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
    lines = ["# Per-op profile of one train step, jaxgpt against torch eager (scripts/benchmarks/profile_step.py)", "",
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
    """The best float32 matmul peak bench_train.py recorded (results/engine/bench_train.json: one
    result, or one per shape), None if there is none."""
    bench = RESULTS / "engine" / "bench_train.json"
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
    ap.add_argument("--out", default=str(RESULTS / "engine" / "profile.json"))
    args = ap.parse_args(argv)
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
    load_start = load_average()
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
    result["load_average"] = {"start": load_start, "end": load_average()}
    write_result(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
