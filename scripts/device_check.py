"""``make device-check``: issue 56's targets measured on a lent GPU by one command of at most 10 minutes.

    make device-check                                    # on the device: PYTHONPATH=. python3 -m scripts.device_check
    make device-check DRY_RUN=1                          # every step at toy size on the CPU, into a temporary folder
    python -m scripts.device_check --only serving --budget serving=300   # one step again, with more time

Steps, one after the other, each a subprocess with its own time budget in seconds, plus what the steps before
it left unused (killed with its children when that runs out; the next step runs all the same; nothing runs
past --total):
  env      the device: nvidia-smi's name and memory, jax.devices(), the framework versions
  race     bench_gpu: jaxgpt's default train step against nanoGPT's model.py + torch.compile, B 12 and 32, T 1024
  decode   bench_gpu's decoding row: cached greedy decoding against HF ``generate`` (gpt2-small, float32)
  tier     ``make test-gpu``: the parity suite on the GPU
  serving  bench_serving_gpu: the Engine against transformers' continuous batching (``generate_batch``'s
           manager), a ~1B LLaMA in bf16, 64 ragged requests, and a float32 token check on 8 requests; last,
           as the step whose time is least known (the engine compiles about 15 shapes of the 1B model)
Output, under $OUT when it is set (the device tool brings back only that folder), else the repository (the
dry run: a temporary folder): results/engine/gpu_check.{md,json} (the targets and the steps),
gpu_check_<step>.{md,json} (each step's tables) and gpu_check_logs/<step>.log; on stdout one
``device-check`` line per target. Exit status 1 when a step failed, timed out or had no time left, or a
target has no measurement (a missed target is a result, not a failure).

nanoGPT's model.py (the race's reference) is not in the repository: --nanogpt DIR, else $NANOGPT_DIR,
else shared/reference/nanogpt beside or inside the clone, else .gpu/nanogpt/ in the clone (copy it there
before a device run: untracked files travel with the working tree). Without it the race runs jaxgpt alone
and its targets say where it was looked for.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.harness import ROOT, SHARED, report

STEPS = ("env", "race", "decode", "tier", "serving")
# Device seconds a step; the sum stays under the device tool's 600 s a command. The race's workers took 133 s
# and decoding's 67 s on an H200 (results/engine/gpu.json).
BUDGETS = {"env": 15, "race": 150, "decode": 80, "tier": 150, "serving": 185}
TOTAL = 585
DRY_BUDGET = 120  # each step of the dry run, whose toy steps take seconds
MIN_STEP = 10  # a step with less time left than this is not started


def find_nanogpt(explicit: str | None) -> tuple[Path | None, list[str]]:
    """The folder holding nanoGPT's model.py, and every place looked in (for the message when none has it)."""
    places = [explicit, os.environ.get("NANOGPT_DIR"), SHARED / "reference" / "nanogpt",
              ROOT / "shared" / "reference" / "nanogpt", ROOT / ".gpu" / "nanogpt"]
    places = [Path(p) for p in places if p]
    return next((p for p in places if (p / "model.py").is_file()), None), [str(p) for p in places]


# ---------------------------------------------------------------- each step: its command and its targets

def env_info() -> dict:
    """(the env step's worker) What device this is: nvidia-smi's line, JAX's devices, the versions."""
    import importlib.metadata as md

    smi = shutil.which("nvidia-smi")
    gpu = None
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15, check=False)
        gpu = q.stdout.strip() or q.stderr.strip()
    import jax

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None
    return {"nvidia_smi": gpu, "jax_devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
            "versions": {p: version(p) for p in ("jax", "jaxlib", "flax", "optax", "torch", "transformers")}}


def command(step: str, ctx: dict) -> tuple[list[str], dict]:
    """The step's command line and the environment variables it adds."""
    py, dry, out = sys.executable, ctx["dry"], ctx["engine"]
    if step == "env":
        return [py, "-m", "scripts.device_check", "--env"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if step in ("race", "decode"):
        argv = [py, "-m", "scripts.benchmarks.bench_gpu", "--out", str(out / f"gpu_check_{step}.md")]
        argv += ["--quick"] if dry else []
        if step == "decode":
            return argv + ["--batches", ""], {}
        argv += ["--no-decode", "--batches", "2" if dry else "12,32"]  # the dry run: one toy batch for both targets
        return argv + (["--nanogpt", str(ctx["nanogpt"])] if ctx["nanogpt"] else []), {}
    if step == "serving":
        argv = [py, "-m", "scripts.benchmarks.bench_serving_gpu", "--out", str(out / "gpu_check_serving.json")]
        toy = ["--size", "quick", "--check-size", "quick", "--requests", "4", "--max-out", "8", "--check-tokens", "2",
               "--no-warm"]
        return argv + (toy if dry else []), {}
    if step == "tier":
        argv = ["make", "--no-print-directory", "test-gpu", f"GPU_PYTHON={py}"]
        toy = ["GPU_BACKEND=cpu", "GPU_WORKERS=0", "GPU_TESTS=parity_tests/unit/test_gpu_policy.py",
               "PYTEST_ARGS=-k the_gpu_tier_runs_on_its_backend"]  # the tier's plumbing: make, pytest, the backend check
        return argv + (toy if dry else []), {}
    raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")


def _short(text: str, most: int = 300) -> str:
    """A detail for one line: its end, where a traceback says what went wrong."""
    return text if len(text) <= most else "..." + text[-most:]


def target(name: str, goal: str, value: float | None, least: float | None, detail: str = "") -> dict:
    """One target's row: MET / MISSED against ``least`` (a ratio), FAILED when nothing was measured."""
    detail = _short(detail)
    if value is None:
        return {"target": name, "goal": goal, "value": "-", "status": "FAILED", "detail": detail}
    return {"target": name, "goal": goal, "value": f"{value:.2f}x", "status": "MET" if value >= least else "MISSED",
            "detail": detail}


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no results in {path.name}: {type(e).__name__}"}


def _why(step: dict, fallback: str) -> str:
    return step.get("error") or fallback


def targets(step: str, ctx: dict, ran: dict) -> list[dict]:
    """The step's targets, read from the files it wrote (or its log)."""
    out, dry = ctx["engine"], ctx["dry"]
    if step == "race":
        res, rows = _json(out / "gpu_check_race.json"), []
        for b in (12, 32):
            arms = res.get("train", {}).get("2" if dry else str(b), {})
            mine, ref = arms.get("jaxgpt", {}), arms.get("nanogpt-compile", {})
            why = ("nanoGPT's model.py not found in " + ", ".join(ctx["looked"]) + ": set NANOGPT_DIR or copy it "
                   "to .gpu/nanogpt/" if not ctx["nanogpt"] else
                   mine.get("error") or ref.get("error") or _why(ran, res.get("error", "no row")))
            ratio = statistics.median(ref["ms"]) / statistics.median(mine["ms"]) \
                if mine.get("ms") and ref.get("ms") else None
            alone = f"jaxgpt {statistics.median(mine['ms']):.1f} ms" if mine.get("ms") else ""
            ms = f"{alone}, nanoGPT {statistics.median(ref['ms']):.1f} ms" if ratio else \
                f"{alone} alone; {why}" if alone else why
            rows.append(target(f"train B {b}" + (" (toy B 2)" if dry else ""),
                               ">= 1.0x nanoGPT + torch.compile tokens/s", ratio, 1.0, ms))
        return rows
    if step == "decode":
        dec = _json(out / "gpu_check_decode.json").get("decode", {})
        j, h = dec.get("jaxgpt", {}), dec.get("hf", {})
        ok = j.get("tok_s") and h.get("tok_s")
        return [target("cached decoding", ">= 5x HF generate tok/s", j["tok_s"] / h["tok_s"] if ok else None, 5.0,
                       f"jaxgpt {j['tok_s']:,.0f} tok/s, HF {h['tok_s']:,.0f} tok/s" if ok else
                       j.get("error") or h.get("error") or _why(ran, "no decoding rows"))]
    if step == "serving":
        res = _json(out / "gpu_check_serving.json")
        by = {r["arm"]: r for r in res.get("rows", []) if "output_tok_per_s" in r}
        errors = "; ".join(f"{r['arm']}: ...{r['error'][-200:]}" for r in res.get("rows", []) if "error" in r)
        ok = {"engine", "hf-batch"} <= set(by)
        e, h = by.get("engine", {}).get("output_tok_per_s"), by.get("hf-batch", {}).get("output_tok_per_s")
        return [target("serving engine", ">= 2x transformers' generate_batch output tok/s", e / h if ok else None, 2.0,
                       f"engine {e:,.0f} tok/s, generate_batch {h:,.0f} tok/s; float32 tokens: "
                       f"{res.get('tokens', 'not checked')}" if ok else errors or _why(ran, "no serving rows"))]
    if step == "tier":
        log = ran.get("log_text", "")
        counts = tier_counts(log)
        text = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no test counts in the log"
        final = bool(counts) and not any("cut off" in k for k in counts)  # pytest finished: a result
        green = ran.get("rc") == 0 and counts.get("passed", 0) > 0 and not counts.get("failed") \
            and not counts.get("errors")
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
        detail = ("first failures: " + ", ".join(failed[:3])) if final and failed else ran.get("error", "")
        return [{"target": "GPU test tier", "goal": "green (make test-gpu)", "value": text,
                 "status": "MET" if green else ("MISSED" if final else "FAILED"), "detail": _short(detail)}]
    return []


def tier_counts(log: str) -> dict:
    """pytest's counts from its final line, or, when it was cut off, from its progress characters."""
    finals = re.findall(r"^=+ (.*\d+ (?:passed|failed|skipped|errors?|deselected).*) in [\d.]+s.* =+$", log, re.M)
    if finals:
        return {k if k != "error" else "errors": int(n) for n, k in
                re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", finals[-1])}
    marks = "".join(re.findall(r"^(?:\S+\.py )?([.sFExX]+)\s*(?:\[\s*\d+%\])?$", log, re.M))  # xdist: no file names
    names = {".": "passed", "F": "failed", "E": "errors", "s": "skipped", "x": "xfailed", "X": "xpassed"}
    return {f"{names[c]} (cut off)": marks.count(c) for c in names if marks.count(c)}


# ---------------------------------------------------------------- the driver

def end_session(p: subprocess.Popen) -> None:
    """End the session ``p`` leads (``p`` and every process it started): SIGTERM, then SIGKILL after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(argv: list[str], env: dict, budget: float, log: Path) -> dict:
    """Run ``argv`` from the repository root in a session of its own, its output in ``log``; past ``budget``
    seconds the whole session (the step's worker processes too) is ended."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            p = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env})
        except OSError as e:
            return {"rc": None, "wall_s": 0.0, "error": f"could not start {argv[0]}: {e}"}
        try:
            rc, error = p.wait(timeout=budget), None
        except subprocess.TimeoutExpired:
            end_session(p)
            rc, error = None, f"timed out after its budget of {budget:.0f} s (ended with its children)"
        except BaseException:  # interrupted (Ctrl-C, the driver's SIGTERM): the step's session must not outlive it
            end_session(p)
            raise
    out = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    if error is None and rc != 0:
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-3:]
        error = f"exited with {rc}: " + " | ".join(tail)[-300:]
    return {**out, "error": error} if error else out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every step at toy size on any backend (CI's slow tier)")
    ap.add_argument("--only", help=f"comma-separated steps, of {','.join(STEPS)}")
    ap.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS", help="a step's own budget")
    ap.add_argument("--total", type=float, default=TOTAL, help="no step starts or runs past this many seconds")
    ap.add_argument("--nanogpt", help="folder holding nanoGPT's model.py")
    ap.add_argument("--out", help="root of results/engine/ (default: $OUT, else the repository; dry run: a temp dir)")
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.env:
        report(env_info())
        return 0
    steps = [s.strip() for s in a.only.split(",")] if a.only else list(STEPS)
    budgets = {s: (DRY_BUDGET if a.dry_run else BUDGETS[s]) for s in STEPS}
    for item in a.budget:
        name, _, sec = item.partition("=")
        budgets[name] = float(sec)
    unknown = sorted(set(steps + list(budgets)) - set(STEPS))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed driver ends its running step
    try:
        return run(a, steps, budgets)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(a: argparse.Namespace, steps: list[str], budgets: dict) -> int:
    """``steps`` one after the other (main's arguments ``a``), their files and summary lines; the exit status."""
    root = Path(a.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="device-check-") if a.dry_run else ROOT))
    engine = root / "results" / "engine"
    (engine / "gpu_check_logs").mkdir(parents=True, exist_ok=True)
    nanogpt, looked = find_nanogpt(a.nanogpt)
    ctx = {"dry": a.dry_run, "engine": engine, "nanogpt": nanogpt, "looked": looked}
    tag = "device-check" + (" [dry run: toy sizes on this machine, not a measurement]" if a.dry_run else "")
    if "race" in steps and not nanogpt:
        print(f"{tag}: MISSING nanoGPT's model.py (looked in {', '.join(looked)}): the race runs jaxgpt alone; "
              "set NANOGPT_DIR or copy it to .gpu/nanogpt/", flush=True)
    started, deadline = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter() + a.total
    ran, rows, env, due = {}, [], {}, time.perf_counter()
    for step in steps:
        log = engine / "gpu_check_logs" / f"{step}.log"
        due += budgets[step]  # this step's budget and what the steps before it left unused
        now = time.perf_counter()
        if deadline - now < MIN_STEP:
            ran[step] = {"rc": None, "wall_s": 0.0,
                         "error": f"not started: {deadline - now:.0f} s left of --total {a.total:.0f}"}
        else:
            budget = max(1.0, min(due, deadline) - now)
            ran[step] = {**run_step(*command(step, ctx), budget, log), "budget_s": round(budget)}
            ran[step]["log_text"] = log.read_text(errors="replace")
        if step == "env":
            found = [json.loads(x[len("RESULT "):]) for x in ran[step].get("log_text", "").splitlines()
                     if x.startswith("RESULT ")]
            env = found[-1] if found else {"error": ran[step].get("error", "no RESULT line")}
        rows += targets(step, ctx, ran[step])
        ran[step].pop("log_text", None)
        state = "ok" if "error" not in ran[step] else ran[step]["error"]
        print(f"{tag} step {step}: {state} ({ran[step]['wall_s']:.0f} s of {ran[step].get('budget_s', 0)} s)",
              flush=True)
        device = env.get("nvidia_smi") or next(iter(env.get("jax_devices", [])), "?")
        jax_dev = ", ".join(env.get("jax_devices", [])) or env.get("error", "env step not run")
        result = {"started": started, "dry_run": a.dry_run, "env": env, "steps": ran, "targets": rows}
        (engine / "gpu_check.json").write_text(json.dumps(result, indent=1))  # after each step: a run cut off
        (engine / "gpu_check.md").write_text(render(result, device, jax_dev))  # later still leaves these
    print(f"{tag} device: {device}; jax: {jax_dev}")
    for r in rows:
        print(f"{tag} {r['target']}: {r['value']} (target {r['goal']}): {r['status']}"
              + (f" - {r['detail']}" if r["detail"] else ""))
    print(f"{tag} wrote {engine / 'gpu_check.md'}", flush=True)
    return 1 if any("error" in r for r in ran.values()) or any(r["status"] == "FAILED" for r in rows) else 0


def render(result: dict, device: str, jax_dev: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in result["env"].get("versions", {}).items() if v)
    lines = [f"# Device check (issue 56): {device} ({result['started']})", ""]
    if result["dry_run"]:
        lines += ["**Dry run**: every step at toy size on this machine, to prove the script; no figure here "
                  "is a measurement.", ""]
    lines += [f"nvidia-smi: {device}; jax.devices(): {jax_dev}; {versions}. Written by `make device-check` "
              "(scripts/device_check.py); each step's own tables are in gpu_check_<step>.md, its output in "
              "gpu_check_logs/.", "", "| target | goal | measured | status | detail |", "|---|---|---|---|---|"]
    lines += [f"| {r['target']} | {r['goal']} | {r['value']} | {r['status']} | {r['detail']} |"
              for r in result["targets"]]
    lines += ["", "| step | budget s | wall s | result |", "|---|---|---|---|"]
    lines += [f"| {s} | {r.get('budget_s', '-')} | {r['wall_s']:.0f} | {r.get('error', 'ok')} |"
              for s, r in result["steps"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
