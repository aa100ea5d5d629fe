"""Race jaxgpt's default GPU train step against nanoGPT's ``model.py`` with ``torch.compile`` (issue 36).

    python -m scripts.benchmarks.bench_gpu --nanogpt ../shared/reference/nanogpt          # the race, writes results/engine/gpu.md
    python -m scripts.benchmarks.bench_gpu --nanogpt PATH --medium                        # + gpt2-medium's memory rows
    python -m scripts.benchmarks.bench_gpu --nanogpt PATH --variant unrolled='{"config": {"scan_unroll": 12}}'
    python -m scripts.benchmarks.bench_gpu --quick                                        # smoke: tiny shapes, any backend

The shapes are nanoGPT's ``bench.py``: GPT-2 124M, B 12 (and 32), T 1024, bias=False, vocab 50304,
exact GELU, no dropout, bf16 compute with float32 weights, AdamW. Arms, each in its own process, run
one after the other:
  nanogpt-compile  nanoGPT's GPT + torch.compile, bf16 autocast, fused AdamW (TF32 on, as bench.py sets it);
  jaxgpt           jaxgpt's train step with its defaults (make_train_step: AdamW, clipping at 1.0, cosine lr),
                   ModelConfig(dtype='bfloat16') and nothing else set;
  jaxgpt-NAME      the same with a --variant's ModelConfig overrides / XLA_FLAGS (exploration).
Each process compiles, runs 3 warm-up steps, then 3 rounds of --steps steps (one sync a round): ms/step
is the median round. MFU = nanoGPT's FLOP estimate (6 N + 12 L d T per token; N without the position
table) / the bf16 matmul peak measured here (8192^3, best of 5, in JAX). Peak memory: JAX's
``peak_bytes_in_use``, torch's ``max_memory_allocated``. The largest batch that fits 80 GB is a
linear fit through two measured batches (memory is linear in B): an estimate, labelled so.
Decoding: gpt2-small float32 greedy decoding of 256 tokens after an 8-token prompt, batch 1:
jaxgpt's ``generate`` (KV cache) against HF ``generate`` (GPT2LMHeadModel from its config, random weights).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.harness import RESULTS, best_of, matmul_peak, report, spawn, step_times

GB80 = 80e9  # the H100's memory, as the issue counts it (80 GB)
SHAPES = {"gpt2-small": dict(d_model=768, n_layer=12, n_head=12), "gpt2-medium": dict(d_model=1024, n_layer=24, n_head=16),
          "quick": dict(d_model=64, n_layer=2, n_head=2)}


def model_overrides(shape: str, seq_len: int) -> dict:
    """jaxgpt ModelConfig fields for nanoGPT's bench.py model (on top of the gpt2-small preset)."""
    vocab = 512 if shape == "quick" else 50304
    return dict(SHAPES[shape], vocab_size=vocab, max_len=seq_len, mlp="gelu", mlp_bias=False, qkv_bias=False,
                o_bias=False, norm_bias=False, dropout=0.0, attn_dropout=0.0, dtype="bfloat16")


def flops_per_step(shape: str, batch: int, seq_len: int) -> float:
    """nanoGPT's estimate_mfu numerator: 6 N + 12 L d T FLOPs per token (N: weights without the position table)."""
    s = SHAPES[shape]
    vocab, d, layers = model_overrides(shape, seq_len)["vocab_size"], s["d_model"], s["n_layer"]
    n = vocab * d + layers * 12 * d * d + (2 * layers + 1) * d  # tied embedding, qkv/o/fc weights, LayerNorm scales
    return (6 * n + 12 * layers * d * seq_len) * batch * seq_len


# ---------------------------------------------------------------- workers (one process each)

def _rounds(step, sync, steps: int) -> list[float]:
    """ms per step of 3 rounds of ``steps`` back-to-back calls of ``step()`` (after 3 untimed), each
    round synchronised by ``sync()`` once at its end."""
    call = lambda state, _: (state, step())
    return [1e3 * step_times(call, None, [None] * (warm + steps), warm=warm, sync=lambda _: sync(), overlap=True)[2][0]
            for warm in (3, 0, 0)]


def worker_jax_train(spec: dict) -> dict:
    import jax
    import numpy as np

    from jaxgpt.config import TrainConfig, get_preset
    from jaxgpt.train.step import init_state, make_train_step

    if spec.get("patch") == "f32-head-grad":  # the head's backward as JAX transposes it (before the logits op, jaxgpt.nn.kernels.linear)
        import jax.numpy as jnp

        from jaxgpt.models import decoder

        def plain(x, w, *, w_rows=False):
            return jnp.einsum("...d,vd->...v" if w_rows else "...d,dv->...v", x, w.astype(x.dtype),
                              preferred_element_type=jnp.float32)
        decoder.logits_matmul = plain
    if spec.get("patch") == "no-gpu-options":  # XLA:GPU's defaults (train.compiled.GPU_OPTIONS off)
        from jaxgpt.train import compiled

        compiled.GPU_OPTIONS = {}
    b, t = spec["batch"], spec["seq_len"]
    from jaxgpt.config import Execution, split_execution

    arch, ex = split_execution(spec.get("config", {}))  # an arm's kernel and scan keys: the Execution
    config = get_preset("gpt2-small").replace(**model_overrides(spec["shape"], t), **arch)
    tc = TrainConfig(batch_size=b, seq_len=t, steps=10_000, execution=Execution(**ex))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (1, b, t + 1), dtype=np.int32)
    batch = jax.device_put({"x": tokens[..., :-1], "y": tokens[..., 1:]})
    state = init_state(config, tc)
    fn = make_train_step(config, tc)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    box = {"state": state}

    def step():
        box["state"], box["metrics"] = compiled(box["state"], batch)

    ms = _rounds(step, lambda: jax.block_until_ready(box["metrics"]), spec["steps"])
    stats = jax.devices()[0].memory_stats() or {}
    return {"ms": ms, "compile_s": compile_s, "loss": float(box["metrics"]["loss"]),
            "peak_bytes": stats.get("peak_bytes_in_use"), "device": jax.devices()[0].device_kind,
            "memory_limit": stats.get("bytes_limit"),
            "attention": _attention_kernels(config, tc.execution), "jax": jax.__version__,
            "compiled_bytes": None if analysis is None else int(analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
                                                                + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)}


def _attention_kernels(config, ex) -> str:
    """Which kernel attention_impl resolves to for a train step of this config (kernels.auto_impl)."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.nn.kernels import auto_impl

    if ex.attention_impl != "auto":
        return ex.attention_impl
    q = jax.ShapeDtypeStruct((1, config.max_len, config.n_head, config.head_dim), jnp.dtype(config.dtype))
    return auto_impl(config.max_len, config.max_len, ex.attention_block, config.attention_dropout, q, plain=True)


def worker_nanogpt_train(spec: dict) -> dict:
    import torch

    sys.path.insert(0, str(Path(spec["nanogpt"]).resolve()))
    from model import GPT, GPTConfig  # nanoGPT's model.py (MIT)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's bench.py
    torch.backends.cudnn.allow_tf32 = True
    b, t = spec["batch"], spec["seq_len"]
    s, vocab = SHAPES[spec["shape"]], model_overrides(spec["shape"], t)["vocab_size"]
    model = GPT(GPTConfig(block_size=t, vocab_size=vocab, n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["d_model"],
                          dropout=0.0, bias=False)).to(device)
    opt = model.configure_optimizers(weight_decay=1e-2, learning_rate=1e-4, betas=(0.9, 0.95), device_type=device)
    if spec.get("compile", True):
        model = torch.compile(model)
    x = torch.randint(vocab, (b, t), device=device)
    y = torch.randint(vocab, (b, t), device=device)
    ctx = torch.amp.autocast(device_type=device, dtype=torch.bfloat16)
    box = {}

    def step():
        with ctx:
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        box["loss"] = loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - t0
    ms = _rounds(step, sync, spec["steps"])
    return {"ms": ms, "compile_s": compile_s, "loss": float(box["loss"]), "torch": torch.__version__,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def worker_jax_peak(spec: dict) -> dict:
    import jax

    return {"tflops": matmul_peak("jax", spec["n"], "bfloat16") / 1e3, "device": jax.devices()[0].device_kind}


def worker_jax_decode(spec: dict) -> dict:
    import jax
    import numpy as np

    from jaxgpt.config import get_preset
    from jaxgpt.inference.generate import generate
    from jaxgpt.models import init_params

    config = get_preset(spec["preset"])
    if spec.get("shape") == "quick":  # a smoke run's tiny GPT-2
        config = config.replace(**SHAPES["quick"], vocab_size=512)
    params = init_params(config, jax.random.PRNGKey(0))
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, (1, spec["prompt"]), dtype=np.int32)
    run = lambda: jax.block_until_ready(generate(config, params, prompt, spec["new"]))
    run()
    best = best_of(run, 3)
    return {"tok_s": spec["new"] / best, "matmul_precision": "auto"}  # the default Execution's


def worker_hf_decode(spec: dict) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    tiny = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=512) if spec.get("shape") == "quick" else {}
    model = GPT2LMHeadModel(GPT2Config(**tiny)).to(device).eval()
    prompt = torch.randint(model.config.vocab_size, (1, spec["prompt"]), device=device)
    kw = dict(max_new_tokens=spec["new"], min_new_tokens=spec["new"], do_sample=False, pad_token_id=0)

    def run():
        with torch.no_grad():
            model.generate(prompt, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    run()
    best = best_of(run, 3)
    return {"tok_s": spec["new"] / best, "transformers": __import__("transformers").__version__}


WORKERS = {"jax-train": worker_jax_train, "nanogpt-train": worker_nanogpt_train, "jax-peak": worker_jax_peak,
           "jax-decode": worker_jax_decode, "hf-decode": worker_hf_decode}


# ---------------------------------------------------------------- driver

def run_worker(kind: str, spec: dict, env: dict | None = None, timeout: float = 900) -> dict:
    """``kind`` in a fresh interpreter (each framework alone in its process); its RESULT line, or an error."""
    t = time.perf_counter()
    try:
        out = spawn("scripts.benchmarks.bench_gpu", "--worker", kind, json.dumps(spec), timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        out = {"error": f"{kind} timed out after {timeout:.0f} s"}
    out["wall_s"] = round(time.perf_counter() - t, 1)
    print(f"  {kind} {json.dumps(spec)[:120]}: {json.dumps(out)[:400]}", flush=True)
    return out


def fit_max_batch(points: list[tuple[int, float]], budget: float = GB80) -> int | None:
    """Largest batch whose peak memory stays under ``budget``, from two measured (batch, bytes) points."""
    points = [(b, m) for b, m in points if m]
    if len(points) < 2 or points[0][0] == points[1][0]:
        return None
    (b0, m0), (b1, m1) = points[:2]
    per_row = (m1 - m0) / (b1 - b0)
    return int((budget - (m0 - b0 * per_row)) // per_row) if per_row > 0 else None


def row(name: str, r: dict, flops: float, peak: float | None, ref_ms: float | None) -> list[str]:
    if "error" in r:
        return [name, "–", "–", "–", "–", "–", r["error"][:160]]
    ms = statistics.median(r["ms"])
    tok = r["tokens"] / (ms / 1e3)
    mfu = f"{100 * flops / (ms / 1e3) / (peak * 1e12):.1f}%" if peak else "–"
    gib = f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "–"
    ratio = f"{ref_ms / ms:.2f}x" if ref_ms else "–"
    return [name, f"{ms:.1f}", f"{tok:,.0f}", ratio, mfu, gib, f"compile {r['compile_s']:.0f} s, loss {r['loss']:.3f}"]


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", help="folder holding nanoGPT's model.py (../shared/reference/nanogpt)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round (3 rounds)")
    ap.add_argument("--batches", default="12,32", help="batch sizes raced (the first is nanoGPT bench.py's; '': none, "
                    "decoding only)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='an extra jaxgpt arm: {"config": {ModelConfig overrides}, "xla_flags": "...", '
                         '"patch": "f32-head-grad" | "no-gpu-options"}')
    ap.add_argument("--medium", action="store_true", help="also gpt2-medium's peak memory at B 8 and 16 (both frameworks)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decoding rows")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on any backend (smoke test), nanoGPT eager")
    ap.add_argument("--out", default=str(RESULTS / "engine" / "gpu.md"))
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="write --out from earlier runs' JSON files merged (later files add to earlier ones)")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        report(WORKERS[args.worker[0]](json.loads(args.worker[1])))
        return 0
    shape, t = ("quick", 32) if args.quick else ("gpt2-small", 1024)
    if args.render:
        results: dict = {}
        for f in args.render:
            for k, v in json.loads(Path(f).read_text()).items():
                results[k] = {**results[k], **v} if isinstance(v, dict) and isinstance(results.get(k), dict) and k != "peak" \
                    else (v if v or k not in results else results[k])
        return _write(args.out, results, shape, t)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.quick and args.batches == ap.get_default("batches"):  # tiny batches unless given
        batches = [2, 4]
    steps = 2 if args.quick else args.steps
    variants = {}
    for v in args.variant:
        name, _, spec = v.partition("=")
        variants[name] = json.loads(spec)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    peak = run_worker("jax-peak", {"n": 256 if args.quick else 8192}) if batches else {}  # the MFU's denominator
    results = {"started": started, "peak": peak, "train": {}, "decode": {}, "memory": {}}
    for b in batches:
        base = dict(shape=shape, batch=b, seq_len=t, steps=steps)
        arms = {}
        if args.nanogpt:
            arms["nanogpt-compile"] = run_worker("nanogpt-train", {**base, "nanogpt": args.nanogpt, "compile": not args.quick})
        arms["jaxgpt"] = run_worker("jax-train", base)
        if b == batches[0]:
            for name, v in variants.items():
                env = {"XLA_FLAGS": v["xla_flags"]} if v.get("xla_flags") else None
                arms[f"jaxgpt-{name}"] = run_worker("jax-train", {**base, "config": v.get("config", {}),
                                                                  "patch": v.get("patch")}, env)
        for r in arms.values():
            r["tokens"] = b * t
        results["train"][b] = arms
        _write(args.out, results, shape, t, echo=False)  # what a run cut off later still leaves
    if args.medium and not args.quick:
        for b in (8, 16):
            base = dict(shape="gpt2-medium", batch=b, seq_len=t, steps=3)
            results["memory"][f"gpt2-medium B {b}"] = {
                "jaxgpt": run_worker("jax-train", base),
                "nanogpt-compile": run_worker("nanogpt-train", {**base, "nanogpt": args.nanogpt}) if args.nanogpt else {}}
    if not args.no_decode:
        spec = {"preset": "gpt2-small", "prompt": 8, "new": 16 if args.quick else 256,
                "shape": "quick" if args.quick else "gpt2-small"}
        results["decode"] = {"jaxgpt": run_worker("jax-decode", spec), "hf": run_worker("hf-decode", spec)}
    return _write(args.out, results, shape, t)


def _write(out: str, results: dict, shape: str, t: int, echo: bool = True) -> int:
    text = render(results, shape, t)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.write_text(text)
    if echo:
        print(text)
    return 0


def render(results: dict, shape: str, t: int) -> str:
    tflops = results["peak"].get("tflops")
    dev = next((r.get("device") for arms in results["train"].values() for r in arms.values() if r.get("device")), "?")
    lines = [f"# GPU train step: jaxgpt defaults against nanoGPT + torch.compile ({results['started']})", "",
             f"Device: {dev}; bf16 matmul peak measured {tflops or 0:.0f} TFLOP/s (8192^3, JAX). Shapes: {shape}, "
             f"T {t}, bf16 compute, float32 weights, AdamW; each arm its own process; ms/step is the median of 3 rounds. "
             "Written by `python -m scripts.benchmarks.bench_gpu`. The loss is the last step's on one random batch "
             "repeated: the learning rates differ (jaxgpt's TrainConfig defaults with warmup, nanoGPT bench.py's 1e-4), "
             "so it shows that each arm trains, not which trains better.", ""]
    header = ["arm", "ms/step", "tokens/s", "vs nanoGPT", "MFU", "peak GiB", "notes"]
    for b, arms in results["train"].items():
        ref = arms.get("nanogpt-compile", {})
        ref_ms = statistics.median(ref["ms"]) if ref.get("ms") else None
        flops = flops_per_step(shape, int(b), t)
        lines += [f"## Batch {b}", "", table([row(n, r, flops, tflops, ref_ms) for n, r in arms.items()], header), ""]
    fits = []
    for name in ("jaxgpt", "nanogpt-compile"):
        pts = [(int(b), arms.get(name, {}).get("peak_bytes")) for b, arms in results["train"].items()]
        fits.append(f"{shape} {name}: {fit_max_batch(pts)}")
    for key, arms in results["memory"].items():
        fits.append(f"{key}: " + ", ".join(f"{n} {r['peak_bytes'] / 2**30:.1f} GiB" for n, r in arms.items()
                                           if r.get("peak_bytes")))
    med = {n: [(int(k.split()[-1]), r.get("peak_bytes")) for k, arms in results["memory"].items()
               for m, r in arms.items() if m == n] for n in ("jaxgpt", "nanogpt-compile")}
    fits += [f"gpt2-medium {n}: {fit_max_batch(p) or 'one measured point only: no estimate'}" for n, p in med.items() if p]
    lines += ["## Largest batch under 80 GB (estimate: a line through two measured peaks)", ""] + [f"- {f}" for f in fits] + [""]
    if results["decode"]:
        j, h = results["decode"]["jaxgpt"], results["decode"]["hf"]
        ratio = f"{j['tok_s'] / h['tok_s']:.1f}x" if j.get("tok_s") and h.get("tok_s") else "–"
        what = "a 2-layer 64-wide GPT-2, float32, batch 1, 8 + 16" if shape == "quick" else \
            "gpt2-small, float32, batch 1, 8 + 256"
        lines += [f"## Decoding ({what} tokens, greedy)", "",
                  f"- jaxgpt generate: {j.get('tok_s', 0):,.0f} tok/s; HF generate: {h.get('tok_s', 0):,.0f} tok/s; {ratio}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
