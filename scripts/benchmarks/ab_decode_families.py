"""Cached decoding of a Llama 3-shaped model against the LLaMA 2-shaped one of the same size, alternating.

    .venv/bin/python -m scripts.benchmarks.ab_decode_families [--rounds 3] [--isa avx2]

The two models differ only in RoPE (Llama 3's ``llama3`` scaling against plain RoPE), so jaxgpt must decode
them at the same speed: the frequencies are constants at trace time. Each round runs ``bench_decode
--family F --frameworks jax-cached`` once per family, in its own process, llama2 then llama3, then the other
way round. Reported: each family's median tokens/s per batch over the rounds, the ratio llama3 / llama2
(issue 53: within 5%), and the 1-minute load average before and after.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.harness import ISAS, ROOT, load_average, write_result

FAMILIES = ("llama2", "llama3")


def run_family(family: str, batches: str, new_tokens: int, isa: str) -> dict[int, float]:
    """{batch: tokens/s} of one bench_decode run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scripts.benchmarks.bench_decode", "--family", family, "--frameworks", "jax-cached",
               "--batches", batches, "--new-tokens", str(new_tokens), "--repeats", "1", "--isa", isa,
               "--out", str(Path(tmp) / "decode.json")]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        rows = json.loads(next(Path(tmp).glob("decode_*.json")).read_text())["rows"]
        return {r["batch"]: r["tok_s"] for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--isa", choices=ISAS, default="native")
    args = ap.parse_args()
    load_before, runs = load_average(), {f: [] for f in FAMILIES}
    for r in range(args.rounds):
        for family in (FAMILIES if r % 2 == 0 else FAMILIES[::-1]):
            runs[family].append(run_family(family, args.batches, args.new_tokens, args.isa))
            print(f"round {r}: {family} {runs[family][-1]}", flush=True)
    batches = sorted(runs["llama2"][0])
    med = {f: {b: statistics.median(run[b] for run in runs[f]) for b in batches} for f in FAMILIES}
    ratio = {b: med["llama3"][b] / med["llama2"][b] for b in batches}
    result = {"isa": args.isa, "rounds": args.rounds, "new_tokens": args.new_tokens, "tok_s": runs, "median_tok_s": med,
              "llama3_over_llama2": ratio, "load_before": load_before, "load_after": load_average()}
    table = ("| batch | llama2 tok/s | llama3 tok/s | llama3 / llama2 |\n|---|---|---|---|\n" + "".join(
        f"| {b} | {med['llama2'][b]:.0f} | {med['llama3'][b]:.0f} | **{ratio[b]:.3f}** |\n" for b in batches)
        + f"\nbench_decode --frameworks jax-cached, {args.new_tokens} new tokens, medians of {args.rounds} alternating "
        f"rounds, --isa {args.isa}; 1-minute load {load_before} before, {result['load_after']} after.\n")
    write_result(ROOT / "results" / "engine" / f"decode_llama3_vs_llama2_{args.isa}.json", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
