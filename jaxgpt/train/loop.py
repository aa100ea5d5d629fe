"""The training loop behind ``jaxgpt train``: resume, step, log, evaluate, checkpoint, plot.

Host work per step is one NumPy batch; metrics stay on the device and are fetched every
``log_every`` steps, so the jitted steps queue up back to back.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.train.checkpoint import Checkpoints
from jaxgpt.train.step import TrainState, init_state, make_eval_step, make_train_step
from jaxgpt.train.tasks import Task, fit_config, load_task


def _differences(a, b) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}={da[k]!r} (saved: {db[k]!r})" for k in da if da[k] != db[k]]


def prepare(out: str | Path, config, tc: TrainConfig, *, data: str | None = None, corpus: str | None = None
            ) -> tuple[object, TrainConfig, Task, TrainState | None]:
    """Model config, TrainConfig, task and the state to resume from (None: a fresh run).

    A fresh run sizes ``config``'s vocabulary to the data's tokenizer. When ``out`` holds a
    checkpoint the run resumes with the saved tokenizer, and any difference between the given and
    the saved configs (or data) is an error: resuming is exact or it does not happen.
    """
    ckpts = Checkpoints(out, create=False) if (Path(out) / "checkpoints").is_dir() else None  # read-only
    if ckpts is None or ckpts.latest_step() is None:
        task = load_task(config, tc, data=data, corpus=corpus)
        return fit_config(config, task), tc, task, None
    saved_config, saved_tc, state, meta = ckpts.restore()
    ckpts.close()
    task = load_task(saved_config, saved_tc, data=data, corpus=corpus, tokenizer=meta["tokenizer"])
    diffs = _differences(fit_config(config, task), saved_config) + _differences(tc, saved_tc)
    if task.source != meta["source"]:
        diffs.append(f"data={task.source!r} (saved: {meta['source']!r})")
    if diffs:
        raise ValueError(f"{out} holds a run with other settings; to resume, drop the changes "
                         f"({'; '.join(diffs)}), or train into a new --out directory")
    return saved_config, saved_tc, task, state


class Progress:
    """One status line: step, loss, tokens/s, ETA. Redrawn in place on a terminal, printed as
    lines otherwise (logs, CI)."""

    def __init__(self, total: int, start: int, stream=sys.stderr, enabled: bool = True):
        self.total, self.start, self.stream, self.enabled = total, start, stream, enabled
        self.tty = enabled and stream.isatty()
        self.t0 = None

    def update(self, step: int, loss: float, tok_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        rate = (step - self.start) / max(time.perf_counter() - self.t0, 1e-9) if self.t0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        eta_s = "?" if math.isnan(eta) else time.strftime("%M:%S", time.gmtime(eta)) if eta < 3600 else f"{eta / 3600:.1f}h"
        width = 24
        filled = int(width * step / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} loss {loss:.4f} "
                f"{tok_s / 1e3:.1f}k tok/s ETA {eta_s}{extra}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def evaluate(config, params, batches: list[dict], eval_step=None) -> dict:
    """Token-mean loss, perplexity and accuracy over ``batches`` (no dropout)."""
    eval_step = eval_step or make_eval_step(config)
    sums = [eval_step(params, b) for b in batches]
    loss_sum, count, correct = (float(sum(s[k] for s in jax.device_get(sums))) for k in ("loss_sum", "count", "correct"))
    loss = loss_sum / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_accuracy": correct / max(count, 1)}


def _read_metrics(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def fit(config, tc: TrainConfig, task: Task, out: str | Path, *, state: TrainState | None = None,
        progress: bool = True, log=print) -> dict:
    """Train from ``state`` (default: ``init_state``) to ``tc.steps``, writing
    ``out/metrics.jsonl``, ``out/checkpoints/`` and ``out/loss.png``. Returns a summary dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = Checkpoints(out, keep=tc.keep)
    state = init_state(config, tc) if state is None else state
    start = int(state.step)
    metrics_path = out / "metrics.jsonl"
    history = _read_metrics(metrics_path, start)  # drop lines written after the checkpoint
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    meta = {"config": config.to_dict(), "train": tc.to_dict(), "tokenizer": task.tokenizer.to_dict(),
            "source": task.source, "kind": task.kind}
    train_step, eval_step, eval_batches = make_train_step(config, tc), make_eval_step(config), task.eval_batches(tc)
    bar = Progress(tc.steps, start, enabled=progress)
    tokens = task.tokens_per_step(tc)
    pending: list[tuple[int, dict]] = []  # (step, metrics still on the device)
    t_flush = time.perf_counter()

    def record(rows: list[dict]) -> None:
        with metrics_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        history.extend(rows)

    def flush(step: int) -> None:
        nonlocal t_flush
        now = time.perf_counter()
        tok_s = tokens * len(pending) / max(now - t_flush, 1e-9)
        steps, metrics = zip(*pending)
        record([{"step": s, **{k: float(v) for k, v in m.items()}, "tok_s": round(tok_s, 1)}
                for s, m in zip(steps, jax.device_get(metrics))])
        pending.clear()
        if bar.t0 is None:  # the first flush includes compilation: rates count from here
            bar.t0, bar.start = now, step
        bar.update(step, history[-1]["loss"], tok_s)
        t_flush = now

    def save() -> None:
        if ckpts.latest_step() != int(state.step):
            ckpts.save(state, meta)

    try:
        for step in range(start, tc.steps):
            state, m = train_step(state, task.batch(tc, step))
            done = step + 1
            pending.append((done, m))
            if done % tc.log_every == 0 or done == tc.steps:
                flush(done)
            if (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps:
                record([{"step": done, **evaluate(config, state.params, eval_batches, eval_step)}])
            if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps:
                save()
    except KeyboardInterrupt:
        if pending:
            flush(int(state.step))
        save()
        ckpts.wait()
        bar.close()
        raise
    bar.close()
    save()
    ckpts.wait()
    ckpts.close()
    train_rows = [r for r in history if "loss" in r]
    val_rows = [r for r in history if "val_loss" in r]
    summary = {"steps": tc.steps, "final_loss": float(np.mean([r["loss"] for r in train_rows[-20:]])) if train_rows else None,
               "val_loss": val_rows[-1]["val_loss"] if val_rows else None,
               "tok_s": float(np.median([r["tok_s"] for r in train_rows[1:]])) if len(train_rows) > 1 else None}
    plot = plot_losses(history, out / "loss.png", title=f"{task.source}")
    if plot is None:
        log("matplotlib is not installed: skipped loss.png (pip install 'jaxgpt[plots]')")
    return summary | {"plot": str(plot) if plot else None}


def plot_losses(history: list[dict], path: Path, title: str = "") -> Path | None:
    """Per-step training loss, its 20-step moving average and the validation loss -> PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    if train:
        s, l = map(np.asarray, zip(*train))
        ax.plot(s, l, alpha=0.3, color="tab:blue", label="train loss (per step)")
        if len(l) >= 20:
            ax.plot(s[19:], np.convolve(l, np.ones(20) / 20, mode="valid"), color="tab:blue", label="train (20-step mean)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", label="validation loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["Progress", "evaluate", "fit", "plot_losses", "prepare"]
