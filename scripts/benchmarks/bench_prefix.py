"""Prefix caching: 64 requests sharing a 512-token system prompt, with and without the cache.

    .venv/bin/python -m scripts.benchmarks.bench_prefix           # -> results/engine/prefix_cache.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_prefix --quick   # smoke: 16 requests, a 128-token prompt, a tiny model

Workload (issue 38): bench_serving's model shape (a random 4-layer, 256-wide LLaMA, vocab 32000,
4 heads) with a 1024-token context; one 512-token system prompt followed by a distinct suffix of
8-32 tokens per request; 32 greedy output tokens each (EOS ignored); all arriving at t=0. The
engine runs in-process (page 16, max_seqs = the requests, 512 tokens a step), with
``enable_prefix_caching`` on and off, the two arms alternating for ``--rounds`` rounds. Every timed
run gets a fresh engine, so its cache starts cold and hits come only from the workload's own
sharing; each arm's programs are compiled by an untimed run first.
Reported per arm: time to first token p50/p99 (from t=0), output tok/s, prefix hit rate (prompt
tokens found cached / looked up), tokens computed, and whether the arms' tokens are identical;
the medians over rounds and the ratios with/without.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from scripts.benchmarks.bench_serving import drain
from scripts.harness import RESULTS, LoadSampler, timing_note, write_result

ARMS = ("no cache", "prefix cache")


def workload(n: int, prefix: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    system = [int(x) for x in rng.integers(3, vocab, prefix)]
    return [system + [int(x) for x in rng.integers(3, vocab, int(rng.integers(8, 33)))] for _ in range(n)]


def model(quick: bool):
    import jax

    from jaxgpt.config import ModelConfig
    from jaxgpt.models import init_params

    shape = (dict(vocab_size=512, d_model=64, n_layer=2, n_head=4, d_ff=128, max_len=256) if quick else
             dict(vocab_size=32000, d_model=256, n_layer=4, n_head=4, d_ff=688, max_len=1024))
    config = ModelConfig(**shape, pos="rope", rope_layout="half", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu")
    return config, init_params(config, jax.random.PRNGKey(0))


def run(config, params, prompts, new: int, cache: bool) -> tuple[list[list[int]], dict]:
    """One timed run on a fresh engine -> (tokens per request, stats)."""
    from jaxgpt.inference.engine import Engine
    from jaxgpt.inference.sampling import SamplingParams

    eng = Engine(config, params, max_seqs=len(prompts), page_size=16, max_tokens_per_step=512,
                 enable_prefix_caching=cache)
    tokens, t0, firsts, _ = drain(eng, prompts, [SamplingParams(max_tokens=new, ignore_eos=True)] * len(prompts))
    wall = time.perf_counter() - t0
    ttft = (np.array(firsts) - t0) * 1000
    s = eng.stats
    computed = sum(len(p) + len(t) - 1 for p, t in zip(prompts, tokens)) - s["prefix_hits"]
    return tokens, dict(wall_s=wall, output_tok_per_s=sum(map(len, tokens)) / wall,
                        ttft_ms_p50=float(np.percentile(ttft, 50)), ttft_ms_p99=float(np.percentile(ttft, 99)),
                        hit_rate=s["prefix_hits"] / max(1, s["prefix_queries"]), tokens_computed=computed,
                        steps=s["steps"], preemptions=s["preemptions"])


def table(arms: dict, same: bool, note: str) -> str:
    lines = ["| arm | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s | prefix hit rate | tokens computed | "
             "engine steps |", "|---|---|---|---|---|---|---|---|"]
    for name, r in arms.items():
        lines.append(f"| {name} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['output_tok_per_s']:.0f} | "
                     f"{r['wall_s']:.2f} | {r['hit_rate']:.2f} | {r['tokens_computed']} | {r['steps']} |")
    off, on = arms[ARMS[0]], arms[ARMS[1]]
    ratios = (f"With the cache: TTFT p50 **{off['ttft_ms_p50'] / on['ttft_ms_p50']:.1f}x** better, p99 "
              f"{off['ttft_ms_p99'] / on['ttft_ms_p99']:.1f}x, output tok/s {on['output_tok_per_s'] / off['output_tok_per_s']:.1f}x; "
              f"greedy tokens identical between the arms: {'yes' if same else 'NO'}.")
    return "\n".join(lines) + f"\n\n{ratios}\n\n{note}\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 requests, a 128-token prompt, a 2x64 model")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prefix", type=int, default=None, help="system prompt tokens (512; 128 with --quick)")
    ap.add_argument("--new", type=int, default=32, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "engine" / "prefix_cache.json"))
    a = ap.parse_args(argv)
    n = a.requests or (16 if a.quick else 64)
    prefix = a.prefix or (128 if a.quick else 512)
    load = LoadSampler()
    load.start()
    uptime_before = os.popen("uptime").read().strip()
    config, params = model(a.quick)
    prompts = workload(n, prefix, config.vocab_size)
    if len(prompts[0]) + 32 + a.new > config.max_len:
        raise SystemExit(f"--prefix {prefix} + a 32-token suffix + --new {a.new} exceed the context ({config.max_len})")
    for cache in (False, True):  # compile each arm's shapes, untimed
        run(config, params, prompts, a.new, cache)
    runs = {name: [] for name in ARMS}
    outputs = {}
    for _ in range(a.rounds):
        for name, cache in zip(ARMS, (False, True)):
            outputs[name], stats = run(config, params, prompts, a.new, cache)
            runs[name].append(stats)
            print(name, stats, file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name in ARMS:
        med[name]["tokens_computed"] = int(med[name]["tokens_computed"])
        med[name]["steps"] = int(med[name]["steps"])
    same = outputs[ARMS[0]] == outputs[ARMS[1]]
    note = (f"{n} requests: a {prefix}-token system prompt + 8-32 distinct tokens each, {a.new} greedy output "
            f"tokens; model {config.n_layer}x{config.d_model} (vocab {config.vocab_size}, context {config.max_len}); "
            f"page 16, 512 tokens a step; medians of {a.rounds} alternating rounds, a fresh engine (cold cache) "
            f"each; {timing_note(load.record())}. uptime before: `{uptime_before}`; after: "
            f"`{os.popen('uptime').read().strip()}`.")
    result = {"arms": med, "runs": runs, "identical": same, "load": load.record(), "note": note,
              "ttft_p50_speedup": med[ARMS[0]]["ttft_ms_p50"] / med[ARMS[1]]["ttft_ms_p50"]}
    text = table(med, same, note)
    if a.quick and a.out == str(RESULTS / "engine" / "prefix_cache.json"):
        print(text)
    else:
        write_result(a.out, result, text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
