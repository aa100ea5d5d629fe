"""Race jaxgpt's jitted train step against torch_ref's training step on the CPU.

    .venv/bin/python -m scripts.benchmarks.bench_train                 # cpu-small + shakespeare-char, 3 A/B rounds
    .venv/bin/python -m scripts.benchmarks.bench_train --quick         # CI smoke: tiny shapes, seconds
    .venv/bin/python -m scripts.benchmarks.bench_train --compile-time  # gpt2-small train-step lower + compile only

Same model config, same batches (random tokens from one seed), same optimizer (TrainConfig
defaults: AdamW, cosine schedule, clipping at 1.0), float32, for:
  torch eager     torch_ref.train.train_step / make_optimizer as written;
  torch.compile   the same step with the model wrapped in torch.compile (inductor; needs a C++ compiler);
  nanogpt-eager   nanoGPT's own model.py and iteration (--nanogpt PATH, a checkout; issue #19's reference);
  jaxgpt-default  jaxgpt.train.step.make_train_step on ModelConfig defaults;
  jaxgpt-...      the same step with the engine settings of JAX_SETTINGS (ModelConfig values a user can
                  set, and the batch split over host CPU devices with jaxgpt.parallel.sharding.use_host_devices).
Each (framework, setting) runs in its own subprocess (thread pools of two frameworks in one process
interfere), one after the other in rounds (A B C D, D C B A, ...); each process compiles, warms up and
then times `steps` steps one by one; the table reports the median over all rounds' steps.

MFU = model FLOPs per step / measured float32 matmul peak. Model FLOPs are nanoGPT's estimate:
6 * N * tokens (N = parameters without the position table) + 12 * n_layer * T * d_model * tokens
(attention scores and mixing, forward + backward). The peak is the best of 5 2048^3 float32
matmuls (``scripts.harness.matmul_peak``) measured in each framework at the start of every round (the best over rounds
is kept for each; both are reported, MFU uses the larger one).
Writes results/engine/bench_train.json and results/engine/bench_train.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import shutil
import sys
import time
from pathlib import Path

from jaxgpt.config import ModelConfig, TrainConfig, get_preset  # imports no framework
from scripts.harness import (ISAS, RESULTS, isa_env, load_average, matmul_peak, report, spawn, step_times,
                             write_result)

# This script races the CPU; the GPU race is scripts/benchmarks/bench_gpu.py.
GPU_NOTE = ("this script measures the CPU only; the GPU race (gpt2-small bf16 against nanoGPT + torch.compile) is "
            "scripts/benchmarks/bench_gpu.py, results/engine/gpu.md")

# nanoGPT style: learned positions, LayerNorm, exact GELU 4x MLP, no biases, tied embeddings, no dropout.
_NANO = dict(vocab_size=65, pos="learned", norm="layernorm", norm_eps=1e-5, norm_bias=False, mlp="gelu",
             mlp_bias=False, qkv_bias=False, o_bias=False, tie_embeddings=True, dropout=0.0, attn_dropout=0.0,
             scale_out_init=True)
SHAPES = {  # name: (config, batch, seq_len, timed steps per process)
    "cpu-small": (ModelConfig(d_model=128, n_layer=4, n_head=4, max_len=64, **_NANO), 12, 64, 20),
    "shakespeare-char": (ModelConfig(d_model=384, n_layer=6, n_head=6, max_len=256, **_NANO), 64, 256, 3),
    "quick": (ModelConfig(d_model=32, n_layer=2, n_head=2, max_len=16, **_NANO), 4, 16, 3),
}
# jaxgpt settings a user can select: ModelConfig overrides (`--set key=value`) and the number of host
# CPU devices the batch is split over (data parallel, params replicated; `jaxgpt train --mesh data=2`).
# Which one wins depends on the shape and on how busy the machine is: docs/performance.md.
JAX_SETTINGS = {
    "jaxgpt-default": {},
    "jaxgpt-remat": {"config": {"remat": "full"}},
    "jaxgpt-unrolled": {"config": {"scan_layers": False}},
    "jaxgpt-unrolled-remat": {"config": {"scan_layers": False, "remat": "full"}},
    "jaxgpt-unrolled-dp2": {"config": {"scan_layers": False}, "host_devices": 2},
    "jaxgpt-remat-dp2": {"config": {"remat": "full"}, "host_devices": 2},
    "jaxgpt-jaxattn": {"config": {"attention_impl": "jax"}},
    "jaxgpt-jaxattn-unrolled-dp2": {"config": {"attention_impl": "jax", "scan_layers": False}, "host_devices": 2},
    # the other side of each 'auto' rule the default follows on a CPU (docs/performance.md, "On other CPUs"):
    # XLA's ops instead of the C++ kernels, one device instead of one per core, a scan of one layer a step
    "jaxgpt-xla-ops": {"config": {"attention_impl": "xla", "norm_impl": "xla", "act_impl": "xla"}},
    "jaxgpt-1dev": {"host_devices": 1},
    "jaxgpt-scan1": {"config": {"scan_unroll": 1}},
}
RUNNERS = ("torch-eager", "torch-compile", "nanogpt-eager") + tuple(JAX_SETTINGS)
QUICK_RUNNERS = ("torch-eager", "jaxgpt-default", "jaxgpt-unrolled-dp2")


def model_flops_per_step(config: ModelConfig, n_params: int, batch: int, seq_len: int) -> float:
    """nanoGPT's estimate_mfu FLOPs: 6 N + 12 L T d per token, N without the position table."""
    n = n_params - (config.max_len * config.d_model if config.pos == "learned" else 0)
    return (6 * n + 12 * config.n_layer * seq_len * config.d_model) * batch * seq_len


def random_batches(config: ModelConfig, batch: int, seq_len: int, n: int, seed: int = 0) -> list[dict]:
    import numpy as np
    w = np.random.default_rng(seed).integers(0, config.vocab_size, size=(n, 1, batch, seq_len + 1), dtype=np.int32)
    return [{"x": b[:, :, :-1], "y": b[:, :, 1:]} for b in w]  # (1, B, T): one micro-batch


# ---------------------------------------------------------------- workers (one per subprocess)

def _row_shards(x) -> int:
    """Into how many pieces the batch rows (axis 1 of (1, B, T)) are split across devices."""
    return x.shape[1] // x.sharding.shard_shape(x.shape)[1]


def placed(config, tc: TrainConfig, batches: list[dict], devices: int | None):
    """(tc, mesh, state, batches on the devices) as the library places them: ``devices`` None keeps the
    defaults (``TrainConfig.mesh='auto'``); n > 1: a data=n mesh (``TrainConfig.mesh``), the state
    and each batch's rows split over it as ``fit`` does (``train.plan``); 1: one device."""
    import jax

    from jaxgpt.train.plan import placer, resolve_mesh
    from jaxgpt.train.step import init_state

    if devices is not None:
        tc = tc.replace(mesh=f"data={devices}" if devices > 1 else "")
    mesh = resolve_mesh(tc)
    place = placer(mesh)
    return tc, mesh, init_state(config, tc, mesh=mesh), [jax.device_put(place(b, 1)) for b in batches]


def _worker_jax(shape: str, setting: str, steps: int) -> dict:
    config, batch, seq_len, _ = SHAPES[shape]
    # a JAX_SETTINGS name, or a JSON {"config": {...}, "host_devices": n} (to try a setting by hand)
    chosen = json.loads(setting) if setting.startswith("{") else JAX_SETTINGS[setting]
    devices = chosen.get("host_devices")  # None: jaxgpt's default (TrainConfig.mesh='auto')
    from jaxgpt import use_host_devices
    use_host_devices("auto" if devices is None else devices)  # before jax initialises its backend
    import jax

    from jaxgpt.models import count_params
    from jaxgpt.train.step import make_train_step
    from jaxgpt.config import Execution, split_execution

    arch, ex = split_execution(chosen.get("config", {}))  # a setting's kernel and scan keys: the Execution
    config = config.replace(**arch)
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=steps + 2, execution=Execution(**ex) if ex else None)
    tc, mesh, state, batches = placed(config, tc, random_batches(config, batch, seq_len, steps + 1), devices)
    devices = devices or jax.device_count()
    n_params = count_params(state.params)
    t = time.perf_counter()
    step = make_train_step(config, tc, mesh=mesh).lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t
    state, metrics, times = step_times(step, state, batches, sync=jax.block_until_ready)  # the first: warm-up
    return {"times_s": times, "compile_s": compile_s, "params": n_params, "loss": float(metrics["loss"]),
            "jax_version": jax.__version__, "batch_shards": _row_shards(batches[0]["x"]),
            "setting": {**chosen.get("config", {}), "host_devices": devices}}


def _worker_torch(shape: str, setting: str, steps: int) -> dict:
    import torch

    import torch_ref
    from torch_ref.train import make_optimizer, train_step
    config, batch, seq_len, _ = SHAPES[shape]
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=steps + 2)
    torch.manual_seed(0)
    if setting == "nanogpt":
        model, step = _nanogpt_model(config, tc)
    else:
        model = torch_ref.build(config).float()
        opt, sched = make_optimizer(model, tc)
        if setting == "compile":
            model = torch.compile(model)
        step = lambda b: train_step(model, opt, sched, tc, b)  # syncs: returns Python floats
    n_params = sum(p.numel() for p in model.parameters())
    batches = random_batches(config, batch, seq_len, steps + 1)
    t = time.perf_counter()
    step(batches[0])  # warm-up (and inductor compile)
    compile_s = time.perf_counter() - t
    _, metrics, times = step_times(lambda _, b: (None, step(b)), None, batches[1:], warm=0)
    return {"times_s": times, "compile_s": compile_s, "params": n_params, "loss": metrics["loss"],
            "torch_version": torch.__version__, "threads": torch.get_num_threads(), "setting": {"mode": setting}}


def _nanogpt_model(config, tc):
    """nanoGPT's own model.py and its training iteration (AdamW groups, clip, ``loss.item()``), from
    the checkout in $NANOGPT_DIR (``--nanogpt``): issue #19's torch reference, faster than torch_ref."""
    import contextlib

    import torch
    sys.path.insert(0, os.environ["NANOGPT_DIR"])
    from model import GPT, GPTConfig

    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count; stdout is the report
        model = GPT(GPTConfig(block_size=tc.seq_len, vocab_size=config.vocab_size, n_layer=config.n_layer,
                              n_head=config.n_head, n_embd=config.d_model, dropout=0.0, bias=False))
        opt = model.configure_optimizers(tc.weight_decay, tc.lr, (tc.beta1, tc.beta2), "cpu")

    def step(b):
        _, loss = model(torch.from_numpy(b["x"][0]).long(), torch.from_numpy(b["y"][0]).long())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.item()}

    return model, step


def _worker_compile_time(preset: str) -> dict:
    """Lower + compile the train step of ``preset`` on abstract shapes (nothing allocated)."""
    import jax

    from jaxgpt.train.step import abstract_state, make_train_step
    config = get_preset(preset)
    tc = TrainConfig(batch_size=8, seq_len=config.max_len)
    state = abstract_state(config, tc)
    batch = {k: jax.ShapeDtypeStruct((1, tc.batch_size, tc.seq_len), "int32") for k in ("x", "y")}
    t = time.perf_counter()
    lowered = make_train_step(config, tc).lower(state, batch)
    lower_s = time.perf_counter() - t
    lowered.compile()
    return {"preset": preset, "batch_size": tc.batch_size, "seq_len": tc.seq_len, "lower_s": lower_s,
            "compile_s": time.perf_counter() - t - lower_s, "total_s": time.perf_counter() - t,
            "scan_layers": True, "n_layer": config.n_layer}  # the default Execution


def _worker(args) -> None:
    kind, _, setting = args.worker.partition(":")
    if kind == "jax":
        out = _worker_jax(args.shape, setting, args.steps)
    elif kind == "torch":
        out = _worker_torch(args.shape, setting, args.steps)
    elif kind == "peak":
        out = {"gflops": matmul_peak(setting, args.peak_n), "n": args.peak_n}
    else:
        out = _worker_compile_time(setting)
    report(out)


# ---------------------------------------------------------------- driver

_WORKER_OF = {"torch-eager": "torch:eager", "torch-compile": "torch:compile", "nanogpt-eager": "torch:nanogpt",
              **{k: f"jax:{k}" for k in JAX_SETTINGS}}


def _spawn(worker: str, shape: str = "quick", steps: int = 1, peak_n: int = 2048, timeout: float = 1800) -> dict:
    return spawn("scripts.benchmarks.bench_train", "--worker", worker, "--shape", shape,
                 "--steps", steps, "--peak-n", peak_n, timeout=timeout)


def _measure_peaks(peaks: dict, n: int) -> None:
    """Update ``peaks`` (framework -> best GFLOP/s so far) with one more measurement in each."""
    for fw in ("jax", "torch"):
        out = _spawn(f"peak:{fw}", peak_n=n)
        if "error" in out:
            raise SystemExit(f"the matmul peak measurement failed: {out['error']}")
        peaks[fw] = max(peaks.get(fw, 0.0), out["gflops"])


def run_shape(shape: str, runners: tuple[str, ...], rounds: int, steps: int, peaks: dict, peak_n: int) -> dict:
    config, batch, seq_len, _ = SHAPES[shape]
    per = {r: [] for r in runners}
    for i in range(rounds):
        _measure_peaks(peaks, peak_n)  # every round: the best of all rounds is the peak (load varies)
        order = runners if i % 2 == 0 else runners[::-1]  # alternate which framework goes first
        for r in order:
            out = _spawn(_WORKER_OF[r], shape, steps)
            per[r].append(out)
            msg = out.get("error") or f"median {1e3 * statistics.median(out['times_s']):.1f} ms/step"
            print(f"  {shape} round {i + 1}/{rounds} {r}: {msg}", file=sys.stderr, flush=True)
    rows = {}
    tokens = batch * seq_len
    for r, outs in per.items():
        ok = [o for o in outs if "error" not in o]
        if not ok:
            rows[r] = {"error": outs[0]["error"]}
            continue
        times = [t for o in ok for t in o["times_s"]]
        med = statistics.median(times)
        flops = model_flops_per_step(config, ok[0]["params"], batch, seq_len)
        rows[r] = {"ms_step": 1e3 * med, "tok_s": tokens / med, "gflops": flops / med / 1e9,
                   "round_medians_ms": [1e3 * statistics.median(o["times_s"]) for o in ok],
                   "compile_s": statistics.median(o["compile_s"] for o in ok), "steps": len(times),
                   "params": ok[0]["params"], "setting": ok[0]["setting"], "loss": ok[0]["loss"],
                   **({"batch_shards": ok[0]["batch_shards"]} if "batch_shards" in ok[0] else {})}
    base = rows.get("torch-eager", {}).get("tok_s")
    for row in rows.values():
        if base and "tok_s" in row:
            row["vs_torch_eager"] = row["tok_s"] / base
    jax_rows = [r for r in rows if r.startswith("jaxgpt") and "tok_s" in rows[r]]
    best = max(jax_rows, key=lambda r: rows[r]["tok_s"], default=None)
    return {"config": config.to_dict(), "batch_size": batch, "seq_len": seq_len, "tokens_per_step": tokens,
            "best_jaxgpt": best,
            "model_flops_per_step": model_flops_per_step(config, next(
                (r["params"] for r in rows.values() if "params" in r), 0), batch, seq_len),
            "rows": rows}


def markdown(result: dict) -> str:
    peak = result["peak_gflops"]
    load = result["load_average"]
    lines = [f"GPU: {result['gpu']}", ""] if "gpu" in result else []
    lines += [(f"float32 matmul peak ({result['peak_n']}^3, best of 5): jax {peak['jax']:.0f} GFLOP/s, "
              f"torch {peak['torch']:.0f} GFLOP/s; MFU against {result['peak']:.0f}. {result['rounds']} rounds, "
              f"{result['machine']}, instruction sets: {result.get('isa', 'native')}, load average "
              f"{load['start']:.1f} at start and {load['end']:.1f} at end."), ""]
    for shape, s in result["shapes"].items():
        c = s["config"]
        lines += [(f"**{shape}**: {c['n_layer']} layers, d_model {c['d_model']}, {c['n_head']} heads, "
                   f"batch {s['batch_size']} x T {s['seq_len']}, vocab {c['vocab_size']}, "
                   f"{s['model_flops_per_step'] / 1e9:.2f} GFLOP/step"),
                  "", "| runner | setting | ms/step (median) | tokens/s | GFLOP/s | MFU | vs torch eager |",
                  "|---|---|---|---|---|---|---|"]
        eager = s["rows"].get("torch-eager")  # the ratio's base: an arm that may not have run or may have failed
        no_ratio = "not run" if eager is None else "torch eager failed" if "error" in eager else "–"
        for name, row in s["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | – | failed: {row['error'][:120]} | | | | |")
                continue
            setting = ", ".join(f"{k}={v}" for k, v in row["setting"].items()) or "defaults"
            ratio = f"{row['vs_torch_eager']:.2f}x" if "vs_torch_eager" in row else no_ratio
            lines.append(f"| {name} | {setting} | {row['ms_step']:.1f} | {row['tok_s']:,.0f} | {row['gflops']:.1f} | "
                         f"{100 * row['mfu']:.0f}% | {ratio} |")
        best = s.get("best_jaxgpt")
        if best and "vs_torch_eager" in s["rows"][best]:
            row = s["rows"][best]
            setting = ", ".join(f"{k}={v}" for k, v in row["setting"].items())
            lines.append(f"Best jaxgpt: {best} ({setting}), {row['vs_torch_eager']:.2f}x torch eager tokens/s, "
                         f"{100 * row['mfu']:.0f}% of the matmul peak.")
        lines.append("")
    ct = result.get("compile_time") or {}
    if "error" in ct:
        lines.append(f"gpt2-small compile time: failed: {ct['error']}")
    elif ct:
        lines.append(f"{ct['preset']} train step (B {ct['batch_size']}, T {ct['seq_len']}, scan_layers="
                     f"{ct['scan_layers']}): lower {ct['lower_s']:.1f} s + compile {ct['compile_s']:.1f} s = "
                     f"{ct['total_s']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cpu-small,shakespeare-char", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--runners", default=None, help=f"comma list of {RUNNERS} (default: all; --quick: {QUICK_RUNNERS})")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds (each runner once per round)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per process (default: per shape)")
    ap.add_argument("--quick", action="store_true", help="CI smoke: the tiny shape, 1 round, 3 steps")
    ap.add_argument("--compile-time", action="store_true", help="only the gpt2-small train-step compile time")
    ap.add_argument("--no-compile-time", action="store_true", help="skip it in the full run")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--nanogpt", help="a karpathy/nanoGPT checkout: runner nanogpt-eager trains its model.py")
    ap.add_argument("--isa", choices=ISAS, default="native", help="cap torch, XLA and jaxgpt's kernels at this "
                    "instruction set in every worker (avx2: how an AVX-512 machine measures an AVX2 one)")
    ap.add_argument("--out", default=None, help="results JSON (default results/engine/bench_train.json; with "
                    "--isa avx2, bench_train_avx2.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="quick", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    os.environ.update(isa_env(args.isa))  # the workers inherit it
    args.out = args.out or str(RESULTS / "engine" / f"bench_train{'' if args.isa == 'native' else '_' + args.isa}.json")
    if args.nanogpt:
        os.environ["NANOGPT_DIR"] = str(Path(args.nanogpt).resolve())  # the workers inherit it
    if args.compile_time:
        ct = _spawn("compile:gpt2-small", timeout=600)
        print(json.dumps(ct, indent=1))
        return ct
    shapes = ["quick"] if args.quick else args.shapes.split(",")
    # torch.compile spends ~1 min in inductor per process: not part of the CI smoke run unless asked for
    runners = tuple(args.runners.split(",")) if args.runners else QUICK_RUNNERS if args.quick else \
        tuple(r for r in RUNNERS if r != "nanogpt-eager" or args.nanogpt)
    if "nanogpt-eager" in runners and not args.nanogpt:
        raise SystemExit("runner nanogpt-eager trains nanoGPT's own model.py: give its checkout with --nanogpt PATH")
    for name, allowed, given in (("shape", SHAPES, shapes), ("runner", RUNNERS, runners)):
        bad = [g for g in given if g not in allowed]
        if bad:
            raise SystemExit(f"unknown {name} {bad}; expected some of {sorted(allowed)}")
    rounds = 1 if args.quick else args.rounds
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    peak_n = 256 if args.quick else args.peak_n
    peaks = {}
    load_start = load_average()  # a loaded machine slows both frameworks, torch's OpenMP pool most
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "isa": args.isa, "peak_n": peak_n, "peak_gflops": peaks,
              "rounds": rounds, "flops": "nanoGPT estimate: 6 N tokens + 12 L T d tokens (N without position table)",
              "jax_settings": JAX_SETTINGS, "shapes": {}}
    for shape in shapes:
        steps = args.steps or (3 if args.quick else SHAPES[shape][3])
        result["shapes"][shape] = run_shape(shape, runners, rounds, steps, peaks, peak_n)
    result["peak"] = max(peaks.values())
    for s in result["shapes"].values():
        for row in s["rows"].values():
            if "gflops" in row:
                row["mfu"] = row["gflops"] / result["peak"]
    if not args.quick and not args.no_compile_time:
        result["compile_time"] = _spawn("compile:gpt2-small", timeout=600)
    result["load_average"] = {"start": load_start, "end": load_average()}
    result["gpu"] = GPU_NOTE if shutil.which("nvidia-smi") is None else "a GPU is present; this script measures the CPU only"
    write_result(args.out, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
