"""Serving throughput on a GPU (issue 56): jaxgpt's Engine against transformers' continuous batching, a ~1B
LLaMA with random weights in bf16, 64 ragged requests all arriving at t=0, greedy, EOS ignored.

    PYTHONPATH=. python3 -m scripts.benchmarks.bench_serving_gpu     # -> results/engine/gpu_serving.{json,md}
    python -m scripts.benchmarks.bench_serving_gpu --size quick --check-size quick --requests 4 --max-out 8  # CPU smoke

Workload: bench_serving's (prompts of 8-96 tokens, outputs exponential with mean 48, capped at 160 or
--max-out). Models, built by the first worker with random weights and saved as HF directories:
  1b     Llama 3.2 1B's body (16 layers, 2048 wide, MLP 8192, 32 heads, 8 KV heads) with a 32000 vocab: 1.1B
  small  bench_serving's CPU model (4 layers, 256 wide, vocab 32000)
  quick  2 layers, 64 wide, vocab 512 (the CPU smoke)
Arms, each in its own process, one after the other (torch on cuda when it sees one; JAX on its default device):
  hf-batch  transformers' continuous batching (``init_continuous_batching``, what ``generate_batch`` runs,
            with its own attention and CUDA-graph defaults) in --dtype, KV blocks for one full context a request
            and 512 tokens a step, as the engine (left to transformers, 5.17 sizes its step from the free memory)
  engine    jaxgpt's Engine, params and compute in --dtype, paged KV cache in the compute dtype
Each arm runs the workload once untimed (other prompt ids: compilation, allocator warm-up) and once timed.
Tokens: the first --check-tokens requests again, on the --check-size model in float32, with HF ``generate``
one request at a time and with the engine, in the same two processes after the timed runs; the table says
how many agree token for token (random-weight logits can tie, so a near-tie may differ: reported, not judged).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from scripts.benchmarks.bench_serving import compare, run_engine, run_hf_batch, run_hf_one, workload
from scripts.harness import RESULTS, report, spawn

TOKENS_PER_STEP = 512  # both arms: the engine's max_tokens_per_step (bench_serving._engine), transformers' max_batch_tokens
SIZES = {"1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8),
         "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4),
         "quick": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4)}


def build(path: Path, size: str, dtype: str, device: str) -> int:
    """A random LLaMA of ``size`` saved at ``path`` in ``dtype`` (initialised on ``device``); its weight count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.to("cpu").save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def requests(n: int, size: str, max_out: int):
    prompts, outs = workload(n, vocab=SIZES[size]["vocab_size"])
    return prompts, [min(o, max_out) for o in outs]


def worker(arm: str, spec: dict) -> dict:
    """One arm's timed run on the big model, then its float32 token check on the small one (an error in the
    check is reported beside the timing, not instead of it)."""
    root, n_check = Path(spec["dir"]), spec["check_tokens"]
    prompts, outs = requests(spec["requests"], spec["size"], spec["max_out"])
    check = requests(n_check, spec["check_size"], spec["max_out"])
    out: dict = {"arm": arm}
    if arm == "hf-batch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        t0 = time.perf_counter()
        out["weights"] = build(root / "big", spec["size"], spec["dtype"], device)
        if n_check:
            build(root / "check", spec["check_size"], "float32", device)
        out["build_s"] = time.perf_counter() - t0
        out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        tokens, stats = run_hf_batch(root / "big", prompts, outs, spec["warm"], device=device, dtype=spec["dtype"],
                                     max_batch_tokens=TOKENS_PER_STEP)
        checker = lambda: run_hf_one(root / "check", *check, device=device)[0]
    else:
        import jax

        out["device"] = str(jax.devices()[0].device_kind)
        t0 = time.perf_counter()
        tokens, stats = run_engine(root / "big", prompts, outs, spec["warm"], dtype=spec["dtype"])
        out["warm_and_timed_s"] = time.perf_counter() - t0
        checker = lambda: run_engine(root / "check", *check, warm=False)[0]
    out.update(stats, output_tokens=sum(len(t) for t in tokens))
    if n_check:
        try:
            out["check_tokens"] = checker()
        except Exception as e:  # noqa: BLE001 - the check's failure is part of the report
            out["check_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def render(result: dict) -> str:
    spec, rows = result["spec"], result["rows"]
    by = {r["arm"]: r for r in rows if "error" not in r}
    base = by.get("hf-batch", {}).get("output_tok_per_s")
    lines = [f"# Serving on {result.get('device', '?')}: jaxgpt's Engine against transformers' continuous batching "
             f"({result['started']})", "",
             f"Model: random LLaMA `{spec['size']}` ({by.get('hf-batch', {}).get('weights', 0) / 1e9:.2f}B weights), "
             f"{spec['dtype']}; {spec['requests']} requests at t=0, prompts 8-96 tokens, outputs capped at "
             f"{spec['max_out']}, greedy, EOS ignored, {TOKENS_PER_STEP} tokens a step in both arms. Each arm in its own process, "
             f"{'after one untimed run' if spec['warm'] else 'no untimed run first (compilation timed)'}. Written by "
             "`python -m scripts.benchmarks.bench_serving_gpu`.", "",
             "| arm | output tok/s | vs hf-batch | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | notes |",
             "|---|---|---|---|---|---|---|"]
    f = lambda v: "-" if v is None else f"{v:.0f}"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | error: {r['error'][:200]} | | | | | |")
            continue
        rel = f"{r['output_tok_per_s'] / base:.2f}x" if base else "-"
        note = (f"build {r['build_s']:.0f} s" if "build_s" in r else
                f"compiled shapes {r.get('compiled_shapes')}, preemptions {r.get('preemptions')}, warm-up + timed run "
                f"{r.get('warm_and_timed_s', 0):.0f} s")
        lines.append(f"| {r['arm']} | {r['output_tok_per_s']:.0f} | {rel} | {r['requests_per_s']:.2f} | "
                     f"{f(r['ttft_ms_p50'])} / {f(r['ttft_ms_p99'])} | {f(r['tpot_ms_p50'])} / {f(r['tpot_ms_p99'])} | "
                     f"{note} |")
    lines += ["", f"Float32 tokens ({spec['check_tokens']} requests, `{spec['check_size']}` model, HF `generate` one "
              f"at a time against the engine): {result.get('tokens', 'not checked')}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=SIZES, default="1b")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-out", type=int, default=160, help="cap on each request's output tokens")
    ap.add_argument("--check-tokens", type=int, default=8, help="float32 token check on this many requests (0: none)")
    ap.add_argument("--check-size", choices=SIZES, default="small")
    ap.add_argument("--no-warm", action="store_true", help="no untimed run first (a smoke run: compiles inside the timing)")
    ap.add_argument("--out", default=str(RESULTS / "engine" / "gpu_serving.json"))
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "SPEC"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        report(worker(a.worker[0], json.loads(a.worker[1])))
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = dict(size=a.size, dtype=a.dtype, requests=a.requests, max_out=a.max_out, check_tokens=a.check_tokens,
                check_size=a.check_size, warm=not a.no_warm)
    result = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "spec": spec, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("hf-batch", "engine"):
            r = spawn("scripts.benchmarks.bench_serving_gpu", "--worker", arm, json.dumps({**spec, "dir": tmp}))
            r.setdefault("arm", arm)
            print(arm, json.dumps({k: v for k, v in r.items() if k != "check_tokens"})[:600], file=sys.stderr, flush=True)
            result["rows"].append(r)
            result["device"] = result.get("device") or r.get("device")
            by = {x["arm"]: x for x in result["rows"]}
            errors = [f"{x['arm']}: {x['check_error']}" for x in by.values() if "check_error" in x]
            if errors:
                result["tokens"] = "check failed: " + "; ".join(errors)
            elif {"hf-batch", "engine"} <= set(by) and all("check_tokens" in x for x in by.values()):
                same, prefix = compare(by["engine"]["check_tokens"], by["hf-batch"]["check_tokens"])
                result["tokens"] = f"{same}/{a.check_tokens} identical, {prefix}/{a.check_tokens} one a prefix of the other"
            out.write_text(json.dumps(result, indent=1))  # after each arm: what a run cut off later still leaves
            out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
