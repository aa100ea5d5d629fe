"""Run every seed experiment (issue 12), one after another, each in its own process.

    .venv/bin/python scripts/run_experiments.py            # all of them, default budgets (~1 h on 2 CPU cores)
    .venv/bin/python scripts/run_experiments.py --smoke    # seconds each: checks that all of them run
    .venv/bin/python scripts/run_experiments.py minigpt attnres   # a subset, by name

Each experiment writes results/<name>/ (figures, <name>.json, README.md with its claimed-vs-measured
table). This runner then writes results/SUMMARY.md: every experiment's table, in order, with its
wall time. (make experiments runs this.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> script; the order runs the quick figure-only experiment first
EXPERIMENTS = {
    "attention_basics": "exp_attention_basics.py",
    "minigpt": "exp_minigpt.py",
    "attnres": "exp_attnres.py",
    "attnres_charlm": "exp_attnres_charlm.py",
    "shakespeare": "exp_shakespeare.py",
    "seed004": "exp_seed004.py",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"experiments to run (default: all): {', '.join(EXPERIMENTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny budgets (CI); results go to --out, not results/")
    p.add_argument("--out", type=Path, help="folder for the results (default: results/; with --smoke a temp folder)")
    args = p.parse_args()
    unknown = sorted(set(args.names) - set(EXPERIMENTS))
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    names = args.names or list(EXPERIMENTS)
    root = args.out or (Path(__import__("tempfile").mkdtemp(prefix="jaxgpt-smoke-")) if args.smoke else ROOT / "results")
    walls, failed = {}, []
    for name in names:
        cmd = [sys.executable, str(ROOT / "scripts" / EXPERIMENTS[name]), "--out", str(root / name)]
        cmd += ["--smoke"] if args.smoke else []
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        walls[name] = round(time.perf_counter() - t, 1)
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {walls[name]} s", flush=True)
        if rc:
            failed.append(name)
    summary = ["# Experiment results\n", "Written by `scripts/run_experiments.py`"
               + (" --smoke (tiny budgets: the numbers mean nothing)" if args.smoke else "") + ".\n"]
    for name in names:
        readme = root / name / "README.md"
        summary.append(f"\n## {name} ({walls[name]} s)\n\n" + (readme.read_text() if readme.exists() else "(no results)\n"))
    (root / "SUMMARY.md").write_text("".join(summary))
    (root / "walls.json").write_text(json.dumps(walls, indent=1) + "\n")
    print(f"wrote {root / 'SUMMARY.md'}; total {sum(walls.values()):.0f} s" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
