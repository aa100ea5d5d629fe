"""Shared pieces of the experiment scripts (scripts/exp_*.py): arguments, a checkpoint-free
training loop with a loss history, mean-and-spread statistics, curve plots and result files.

Every experiment script writes ``results/<name>/`` (PNG figures, ``<name>.json`` and a short
``README.md`` table) and takes ``--smoke`` (seconds, for CI: tiny budgets, written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def parse(doc: str, name: str, *, seeds: int = 3, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """Arguments every experiment takes: --out (default results/<name>), --smoke, --seeds N."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / name, help=f"results folder (default results/{name})")
    p.add_argument("--smoke", action="store_true", help="tiny budgets, for CI (seconds): checks the script runs")
    p.add_argument("--seeds", type=int, default=seeds, help=f"seeds per configuration (default {seeds})")
    if extra:
        extra(p)
    args = p.parse_args()
    if args.smoke:
        args.seeds = min(args.seeds, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    _LOAD.start()
    return args


class _LoadSampler(threading.Thread):
    """The 1-minute load average every 15 s while an experiment runs, so its timings say whether
    other jobs shared the 2 cores (the experiment itself accounts for up to ~2)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []

    def start(self):
        if not self.is_alive() and not self.samples:
            self.samples.append(os.getloadavg()[0])
            super().start()

    def run(self):
        while True:
            time.sleep(15)
            self.samples.append(os.getloadavg()[0])


_LOAD = _LoadSampler()
BUSY_LOAD = 3.0  # above this 1-minute load average, other jobs competed for the 2 cores


def load_record() -> dict:
    s = _LOAD.samples or [os.getloadavg()[0]]
    return {"median": round(statistics.median(s), 2), "max": round(max(s), 2), "samples": len(s),
            "quiet": max(s) <= BUSY_LOAD}


def timing_note(record: dict | None = None) -> str:
    """How to read a run's timings, from the load sampled while it ran (``record``: a saved
    ``load_record()``, e.g. from a results JSON; default: this process's)."""
    r = record or load_record()
    if r["quiet"]:
        return f"measured on a quiet machine (1-min load average median {r['median']}, max {r['max']})"
    return (f"measured under load (1-min load average median {r['median']}, max {r['max']}: "
            "other jobs shared the 2 CPU cores)")


def shakespeare() -> Path:
    if not SHAKESPEARE.exists():
        raise SystemExit(f"{SHAKESPEARE} is missing: the experiment reads ../shared/data/tinyshakespeare.txt "
                         "(the shared folder sits beside the repository)")
    return SHAKESPEARE


def train(config, tc, task, *, params=None, eval_every: int = 0, log_every: int = 10,
          on_eval: Callable[[int, Any], dict] | None = None) -> dict:
    """``tc.steps`` updates of jaxgpt's jitted train step on ``task.batch(tc, step)``; no checkpoints.

    Metrics stay on the device and are fetched every ``log_every`` steps (no per-step host sync).
    ``eval_every``: validation loss on ``task.eval_batches`` (when the task has a validation split)
    and ``on_eval(step, params) -> dict`` every that many steps and at the end.
    Returns {history: [{step, loss, lr, ...}], params, seconds (training only, compile excluded),
    ms_per_step (median over log windows), compile_s}.
    """
    import jax

    from jaxgpt.train import make_eval_step, make_train_step
    from jaxgpt.train.loop import evaluate
    from jaxgpt.train.step import init_state

    state = init_state(config, tc, params=params)
    step_fn = make_train_step(config, tc)
    eval_batches = task.eval_batches(tc)
    eval_step = make_eval_step(config) if eval_batches else None
    history: list[dict] = []
    pending: list[tuple[int, Any]] = []
    windows: list[float] = []
    t0 = time.perf_counter()
    state, m = step_fn(state, task.batch(tc, 0))  # compile + step 1
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    pending.append((1, m))
    train_s, t_win, n_win = 0.0, time.perf_counter(), 0

    def flush():
        for s, row in zip((s for s, _ in pending), jax.device_get([m for _, m in pending])):
            history.append({"step": s, "loss": float(row["loss"]), "lr": float(row["lr"]),
                            "accuracy": float(row["accuracy"])})
        pending.clear()

    def scores(step):
        row = {"step": step}
        if eval_batches:
            row |= evaluate(config, state.params, eval_batches, eval_step)
        if on_eval:
            row |= on_eval(step, state.params)
        return row

    for step in range(1, tc.steps):
        state, m = step_fn(state, task.batch(tc, step))
        pending.append((step + 1, m))
        n_win += 1
        done = step + 1
        at_eval = bool(eval_every) and (done % eval_every == 0 or done == tc.steps)
        if done % log_every == 0 or at_eval or done == tc.steps:
            flush()
            now = time.perf_counter()
            train_s += now - t_win
            windows.append((now - t_win) / n_win)
            if at_eval:
                history.append(scores(done))
            t_win, n_win = time.perf_counter(), 0
    flush()
    if eval_every and tc.steps == 1:
        history.append(scores(1))
    return {"history": history, "params": state.params, "seconds": train_s + compile_s, "compile_s": compile_s,
            "ms_per_step": 1e3 * statistics.median(windows) if windows else None}


def curve(history: list[dict], key: str = "loss") -> tuple[list[int], list[float]]:
    rows = [r for r in history if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (the first window-1 points average what exists so far)."""
    v = np.asarray(values, float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    n = np.minimum(np.arange(1, len(v) + 1), window)
    return (c[1:] - c[np.arange(len(v)) + 1 - n]) / n


def stats(values: Sequence[float]) -> dict:
    """Mean and spread of per-seed values: mean, std (sample, 0 for one value), min, max, n, values."""
    v = [float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "values": list(values)}
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "min": min(v), "max": max(v), "n": len(v), "values": v}


def pm(s: dict, digits: int = 3) -> str:
    """'mean ± std (n)' for a ``stats`` dict."""
    if not s["n"]:
        return "n/a"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} (n={s['n']})"


def first_step_below(steps: Sequence[int], values: Sequence[float], threshold: float) -> int | None:
    for s, v in zip(steps, values):
        if v < threshold:
            return int(s)
    return None


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_runs(runs: dict[str, list[tuple[Sequence[float], Sequence[float]]]], path: Path, *, xlabel="step",
              ylabel="loss", title="", smooth_window: int = 1, logy: bool = False) -> Path:
    """One line per label: the mean over its runs (seeds), with a min-max band. Each run is
    (x, y); runs of one label share x."""
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 4.5))
    for i, (label, rs) in enumerate(runs.items()):
        n = min(len(y) for _, y in rs)
        x = np.asarray(rs[0][0][:n], float)
        ys = np.stack([smooth(y[:n], smooth_window) for _, y in rs])
        color = f"C{i}"
        ax.plot(x, ys.mean(0), color=color, label=f"{label} (n={len(rs)})")
        if len(rs) > 1:
            ax.fill_between(x, ys.min(0), ys.max(0), color=color, alpha=0.2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def write_results(out: Path, name: str, results: dict, markdown: str, *, smoke: bool, started: float) -> Path:
    """``out/<name>.json`` (with wall time and the smoke flag) and ``out/README.md``."""
    results = {"experiment": name, "smoke": smoke, "wall_s": round(time.perf_counter() - started, 1),
               "load": load_record(), **results}
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    (out / "README.md").write_text(markdown)
    print(f"wrote {path} ({results['wall_s']} s)")
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
