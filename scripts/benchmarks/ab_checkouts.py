"""A/B one jaxgpt benchmark across two checkouts (e.g. before and after a change), alternating.

    .venv/bin/python -m scripts.benchmarks.ab_checkouts BEFORE_DIR AFTER_DIR [--rounds 3] [--isa avx2]
        [--bench train|decode|serving] [--shape cpu-small] [--out results/engine/ab_checkouts.json]

Each round runs the benchmark once in each checkout, in its own process, in the order A B, then B A, ...
(so neither side always runs first on a warm machine), with this interpreter:
- train: ``bench_train --runners jaxgpt-default --rounds 1``, ms a step (``--shape``);
- decode: ``bench_decode --family llama3 --frameworks jax-cached``, batch 1 and 8, 256 new tokens, seconds a run;
- serving: ``bench_serving --arms engine --rounds 1``, 32 requests, wall seconds.
Reported: each side's median time over all rounds, the ratio after / before (< 1: faster), and the
1-minute load average before and after the whole run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.harness import ISAS, ROOT, load_average, write_result


# bench: (module, its arguments, (result json) -> this round's times)
BENCHES = {
    "train": lambda a: ("bench_train", ["--shapes", a.shape, "--runners", "jaxgpt-default", "--rounds", "1",
                                        "--steps", str(a.steps), "--no-compile-time"],
                        lambda r: r["shapes"][a.shape]["rows"]["jaxgpt-default"]["round_medians_ms"]),
    "decode": lambda a: ("bench_decode", ["--family", "llama3", "--frameworks", "jax-cached", "--batches", "1,8", "--new-tokens", "256",
                                          "--repeats", "1"],
                         lambda r: [sum(row["seconds"] for row in r["rows"])]),
    "serving": lambda a: ("bench_serving", ["--arms", "engine", "--rounds", "1", "--requests", "32"],
                          lambda r: [row["wall_s"] for row in r["rows"] if row["arm"] == "engine"]),
}
UNITS = {"train": "ms a step", "decode": "s for batch 1 + batch 8, 256 tokens", "serving": "s for 32 requests"}


def run_side(repo: Path, args) -> list[float]:
    module, argv, times = BENCHES[args.bench](args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", f"scripts.benchmarks.{module}", *argv, "--isa", args.isa, "--out", str(out)]
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": str(repo)})
        written = out if out.exists() else next(Path(tmp).glob("*.json"))  # bench_decode names its own file
        return times(json.loads(written.read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--bench", choices=list(BENCHES), default="train")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--shape", default="cpu-small")
    ap.add_argument("--isa", choices=ISAS, default="native")
    ap.add_argument("--out", default=str(ROOT / "results" / "engine" / "ab_checkouts.json"))
    args = ap.parse_args()
    load_before, ms = load_average(), {"before": [], "after": []}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            ms[side] += run_side(getattr(args, side), args)
            print(f"round {r}: {side} {ms[side][-1]:.3f}", flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    result = {"bench": args.bench, "unit": UNITS[args.bench], "shape": args.shape, "isa": args.isa,
              "rounds": args.rounds, "steps": args.steps,
              "before": str(args.before), "after": str(args.after), "ms_per_step": ms, "median_ms": med,
              "after_over_before": med["after"] / med["before"], "load_before": load_before,
              "load_after": load_average()}
    table = (f"| side | median {UNITS[args.bench]} | per round |\n|---|---|---|\n" + "".join(
        f"| {k} | {med[k]:.2f} | {', '.join(f'{v:.2f}' for v in ms[k])} |\n" for k in ("before", "after"))
        + f"\nafter / before: **{result['after_over_before']:.3f}** (time; < 1 is faster). {args.bench}"
        f"{' ' + args.shape if args.bench == 'train' else ''}, {args.rounds} alternating rounds, --isa {args.isa}; "
        f"1-minute load {load_before} before, {result['load_after']} after.\n")
    write_result(Path(args.out), result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
