"""What the experiments (scripts/experiments/exp_*.py) share: arguments, the training call (jaxgpt's
own loop, ``jaxgpt.train.loop.fit`` without checkpoints), mean-and-spread statistics, curve plots and
result files.

Every experiment writes ``results/<name>/`` (PNG figures, ``<name>.json`` and a short ``README.md``
table) and takes ``--smoke`` (seconds, for CI: tiny budgets, written to ``--out``). Run them from the
repository root: ``.venv/bin/python -m scripts.experiments.exp_attnres --smoke``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from scripts.harness import RESULTS, ROOT, SHARED, LoadSampler, timing_note as _note

SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"
_LOAD = LoadSampler()

__all__ = ["ROOT", "RESULTS", "SHAKESPEARE", "parse", "load_record", "timing_note", "shakespeare", "train", "curve",
           "smooth", "stats", "pm", "first_step_below", "plt", "plot_runs", "table", "write_results", "json_default"]


def parse(doc: str, name: str, *, seeds: int = 3, extra=None):
    """Arguments every experiment takes: --out (default results/<name>), --smoke, --seeds N; starts
    the load-average sampler."""
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


def load_record() -> dict:
    """The load average sampled while this experiment ran (median, max, quiet)."""
    return _LOAD.record()


def timing_note(record: dict | None = None) -> str:
    """How to read a run's timings, from the load sampled while it ran (``record``: a saved
    ``load_record()``, e.g. from a results JSON; default: this process's)."""
    return _note(record or load_record())


def shakespeare() -> Path:
    if not SHAKESPEARE.exists():
        raise SystemExit(f"{SHAKESPEARE} is missing: the experiment reads ../shared/data/tinyshakespeare.txt "
                         "(the shared folder sits beside the repository)")
    return SHAKESPEARE


def train(config, tc, task, *, params=None, **fit_kw) -> dict:
    """``jaxgpt.train.loop.fit`` with no checkpoints, run directory or progress bar, from ``params``
    (default: ``init_state``'s): the one training loop, with its host batch checks and NaN stop.
    ``fit_kw``: until, on_log, on_eval, train_steps / eval_step (reuse one compiled program across seeds).
    Returns fit's summary (history: every update's metrics and every evaluation row; compile_s apart
    from train_s; ms_per_step) with the final ``params``."""
    from jaxgpt.train.loop import fit
    from jaxgpt.train.step import init_state

    state = None if params is None else init_state(config, tc, params=params)
    r = fit(config, tc, task, state=state, checkpoints=False, progress=False, **fit_kw)
    return r | {"params": r["state"].params}


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
    ax.legend()
    from jaxgpt.train.plots import save_figure

    return save_figure(fig, path, [ax], dpi=110)


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
    path.write_text(json.dumps(results, indent=1, default=json_default) + "\n")
    (out / "README.md").write_text(markdown)
    print(f"wrote {path} ({results['wall_s']} s)")
    return path


def json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
