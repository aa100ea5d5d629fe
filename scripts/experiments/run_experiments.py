"""Run every seed experiment (issue 12), one after another, each in its own process.

    .venv/bin/python -m scripts.experiments.run_experiments            # all, default budgets (~1 h on 2 CPU cores)
    .venv/bin/python -m scripts.experiments.run_experiments --smoke    # seconds each: checks that all of them run
    .venv/bin/python -m scripts.experiments.run_experiments minigpt attnres   # a subset, by name
    .venv/bin/python -m scripts.experiments.run_experiments --full     # the seeds' full budgets (~2 h): the committed results
    .venv/bin/python -m scripts.experiments.run_experiments --collect  # run nothing: rebuild SUMMARY.md and CLAIMS.md

Each experiment writes results/<name>/ (figures, <name>.json, README.md with its claimed-vs-measured
table). This runner then writes results/SUMMARY.md: every experiment's table, in order, with its
wall time (its relative links rebased onto results/), and results/CLAIMS.md: every claim of every experiment in one table. (make experiments
runs this.)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from scripts.harness import ROOT

# name -> module (scripts.experiments.<module>); the order runs the quick figure-only experiment first
EXPERIMENTS = {name: f"exp_{name}" for name in
               ("attention_basics", "minigpt", "attnres", "attnres_charlm", "shakespeare", "seed004", "moe")}
WRITER = "`python -m scripts.experiments.run_experiments`"


def claim_rows(results: dict) -> list[dict]:
    """An experiment's claimed-vs-measured rows as {source, claim, measured, verdict}, whichever of
    the scripts' shapes its JSON uses (a list of dicts, or of [claim, claimed, measured, verdict])."""
    rows = results.get("claim_rows") or results.get("claims")
    if not isinstance(rows, list):
        return []
    out = []
    for r in rows:
        if isinstance(r, dict):
            src = r.get("source") or (f"seed {r['seed']}" if r.get("seed") else "")
            out.append({"source": src, "claim": r["claim"], "measured": r["measured"], "verdict": r["verdict"]})
        else:
            claim, claimed, measured, verdict = r
            out.append({"source": "", "claim": claim, "measured": f"{measured} (claimed: {claimed})", "verdict": verdict})
    return out


_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def rebase_links(markdown: str, folder: str) -> str:
    """``markdown`` written for results/<folder>/README.md, for a file one level up: relative link and
    image targets get the ``folder/`` prefix (absolute paths, URLs and #anchors are left alone)."""
    def fix(m):
        if re.match(r"([a-z][a-z0-9+.-]*:|/|#)", m.group(2), re.I):
            return m.group(0)
        return f"{m.group(1)}{folder}/{m.group(2)}{m.group(3)}"

    return _LINK.sub(fix, markdown)


def write_summary(root: Path, names, walls: dict, *, smoke: bool = False) -> Path:
    """results/SUMMARY.md: every experiment's README in order, with its wall time (from the runner,
    or the experiment's own JSON when collected afterwards) and its links rebased onto results/."""
    summary = ["# Experiment results\n", f"Written by {WRITER}"
               + (" --smoke (tiny budgets: the numbers mean nothing)" if smoke else "") + ".\n"]
    for name in names:
        readme, path = root / name / "README.md", root / name / f"{name}.json"
        wall = walls.get(name) or (json.loads(path.read_text()).get("wall_s") if path.exists() else None)
        body = rebase_links(readme.read_text(), name) if readme.exists() else "(no results)\n"
        summary.append(f"\n## {name} ({f'{wall} s' if wall is not None else 'not run'})\n\n{body}")
    (root / "SUMMARY.md").write_text("".join(summary))
    return root / "SUMMARY.md"


def write_claims(root: Path) -> Path:
    """results/CLAIMS.md: every experiment's claimed-vs-measured rows in one file, with a count of verdicts."""
    parts, counts = [], {}
    for name in EXPERIMENTS:
        path = root / name / f"{name}.json"
        if not path.exists():
            continue
        rows = claim_rows(json.loads(path.read_text()))
        for r in rows:
            v = r["verdict"]
            key = "holds" if v.startswith("holds") else "does not hold" if v.startswith("does not") else \
                "not measurable here" if v.startswith("not measurable") else "other"
            counts[key] = counts.get(key, 0) + 1
        cell = lambda t: str(t).replace("|", "\\|").replace("\n", " ")
        parts.append(f"\n## {name} ([details]({name}/README.md))\n\n| source | claim | measured | verdict |\n|---|---|---|---|\n"
                     + "".join(f"| {cell(r['source'])} | {cell(r['claim'])} | {cell(r['measured'])} | {cell(r['verdict'])} |\n"
                               for r in rows))
    head = ["# Every claim, claimed vs measured\n\n", f"Written by {WRITER} (`--collect` rebuilds it from "
            "the results JSON files without running anything). Verdicts: "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".\n"]
    path = root / "CLAIMS.md"
    path.write_text("".join(head + parts))
    print(f"wrote {path}")
    return path


# --full: the seeds' own budgets where the default cuts them (the committed results): ~2 h on a
# quiet 2-core CPU, against ~1 h for the defaults.
FULL = {
    "minigpt": ["--epochs", "15"],  # the seed's 15 epochs (the default runs the first)
    "attnres": ["--epochs", "300"],  # the seed's 300 epochs (default 60)
    "attnres_charlm": ["--steps", "300", "--variants", "paper,seed"],  # default 60 updates, paper variant only
    "shakespeare": ["--parts", "seed003,nanogpt,big,ablation", "--big-seconds", "300"],  # default big 120 s, no ablation
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"experiments to run (default: all): {', '.join(EXPERIMENTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny budgets (CI); results go to --out, not results/")
    p.add_argument("--out", type=Path, help="folder for the results (default: results/; with --smoke a temp folder)")
    p.add_argument("--full", action="store_true", help="the seeds' full budgets (see FULL; ~2 h): the committed results")
    p.add_argument("--collect", action="store_true",
                   help="run nothing: rebuild SUMMARY.md and CLAIMS.md from the saved results")
    args = p.parse_args()
    if args.collect:
        root = args.out or ROOT / "results"
        write_summary(root, list(EXPERIMENTS), {})
        write_claims(root)
        return 0
    unknown = sorted(set(args.names) - set(EXPERIMENTS))
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    names = args.names or list(EXPERIMENTS)
    root = args.out or (Path(__import__("tempfile").mkdtemp(prefix="jaxgpt-smoke-")) if args.smoke else ROOT / "results")
    walls, failed = {}, []
    for name in names:
        cmd = [sys.executable, "-m", f"scripts.experiments.{EXPERIMENTS[name]}", "--out", str(root / name)]
        cmd += ["--smoke"] if args.smoke else FULL.get(name, []) if args.full else []
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        walls[name] = round(time.perf_counter() - t, 1)
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {walls[name]} s", flush=True)
        if rc:
            failed.append(name)
    write_summary(root, list(EXPERIMENTS), walls, smoke=args.smoke)
    write_claims(root)
    print(f"wrote {root / 'SUMMARY.md'}; total {sum(walls.values()):.0f} s" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
