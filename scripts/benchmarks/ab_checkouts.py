"""A/B one jaxgpt benchmark across two checkouts (e.g. before and after a change), alternating.

    .venv/bin/python -m scripts.benchmarks.ab_checkouts BEFORE_DIR AFTER_DIR [--rounds 3] [--isa avx2]
        [--shape cpu-small] [--out results/engine/ab_checkouts.json]

Each round runs ``bench_train --runners jaxgpt-default --rounds 1`` once in each checkout, in its own
process, in the order A B, then B A, ... (so neither side always runs first on a warm machine), with this
interpreter. Reported: each side's median step time over all rounds' steps, the ratio after / before,
and the 1-minute load average before and after the whole run.
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


def run_side(repo: Path, shape: str, steps: int, isa: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "scripts.benchmarks.bench_train", "--shapes", shape, "--runners", "jaxgpt-default",
               "--rounds", "1", "--steps", str(steps), "--no-compile-time", "--isa", isa, "--out", str(out)]
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": str(repo)})
        row = json.loads(out.read_text())["shapes"][shape]["rows"]["jaxgpt-default"]
        return row["round_medians_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--shape", default="cpu-small")
    ap.add_argument("--isa", choices=ISAS, default="native")
    ap.add_argument("--out", default=str(ROOT / "results" / "engine" / "ab_checkouts.json"))
    args = ap.parse_args()
    load_before, ms = load_average(), {"before": [], "after": []}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            ms[side] += run_side(getattr(args, side), args.shape, args.steps, args.isa)
            print(f"round {r}: {side} {ms[side][-1]:.2f} ms", flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    result = {"shape": args.shape, "isa": args.isa, "rounds": args.rounds, "steps": args.steps,
              "before": str(args.before), "after": str(args.after), "ms_per_step": ms, "median_ms": med,
              "after_over_before": med["after"] / med["before"], "load_before": load_before,
              "load_after": load_average()}
    table = ("| side | median ms / step | per round |\n|---|---|---|\n" + "".join(
        f"| {k} | {med[k]:.2f} | {', '.join(f'{v:.2f}' for v in ms[k])} |\n" for k in ("before", "after"))
        + f"\nafter / before: **{result['after_over_before']:.3f}** (time; < 1 is faster). {args.shape}, "
        f"bench_train's jaxgpt-default, {args.rounds} alternating rounds of {args.steps} steps, --isa {args.isa}; "
        f"1-minute load {load_before} before, {result['load_after']} after.\n")
    write_result(Path(args.out), result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
