"""The training loop behind ``jaxgpt train`` and every experiment in scripts/experiments: resume,
step, log, evaluate, checkpoint, plot (``fit(checkpoints=False)``: no orbax, no run directory needed).

Updates run ``TrainConfig.steps_per_call`` at a time (default: ``log_every``): one call of
``make_train_steps`` loops over a stack of batches inside the program, so a CPU host whose cores
all run the step spends its time on one dispatch, one transfer and one fetch per call, not per
update (docs/performance.md). The batches are built ahead by a prefetch
thread (``jaxgpt.data.prefetch``); a call ends where the loop logs, evaluates or saves, and its
metrics stay on the device until then. They are also fetched before
every evaluation and checkpoint, so a NaN/inf loss is seen before anything is saved after it:
``on_nonfinite='stop'`` raises ``NonFiniteLoss`` naming the first bad step (the checkpoints on
disk all hold finite weights); ``'skip'`` counts the updates the jitted step skipped.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.data.prefetch import Prefetch
from jaxgpt.train.progress import Progress
from jaxgpt.train.checkpoint import Checkpoints, damage_summary, to_execution, warn
from jaxgpt.parallel.hosts import barrier, is_primary
from jaxgpt.train.plots import plot_expert_load, plot_losses
from jaxgpt.train.plan import Plan, make_plan, resolve_mesh
from jaxgpt.train.step import TrainState, init_state, make_eval_step
from jaxgpt.data.tasks import Task, fit_config, load_task, with_epochs
from jaxgpt.core.validate import check_batch
from jaxgpt.parallel.host_devices import use_host_devices


PREFETCH_DEPTH = 2  # batches built ahead of the device (host memory: depth x one batch)
ENGINE = ("mesh", "steps_per_call", "execution")  # TrainConfig fields a run may change when it resumes: not math


def _differences(a, b) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}={da[k]!r} (saved: {db[k]!r})" for k in da if da[k] != db[k] and k not in ENGINE]


def prepare(out: str | Path, config, tc: TrainConfig, *, data: str | None = None, corpus: str | None = None,
            vocab_size: int | None = None) -> tuple[object, TrainConfig, Task, TrainState | None]:
    """Model config, TrainConfig, task and the state to resume from (None: a fresh run).

    A fresh run sizes ``config``'s vocabulary to the data's tokenizer (``vocab_size``: a padded table of
    that many rows instead, ``fit_config``). When ``out`` holds a
    checkpoint the run resumes with the saved tokenizer, and any difference between the given and
    the saved configs (or data) is an error: resuming is exact or it does not happen. The ENGINE
    fields are the given ones: another mesh, or another Execution (kernels, layer scan, precision;
    the state is moved to its params layout), continues the same run.
    """
    # Multi-host: every process looks for checkpoints before any of them starts fit (which creates the
    # directory), so they all agree on fresh run vs resume and open orbax the same number of times.
    barrier("jaxgpt prepare")
    quiet = lambda _: None  # the fallback is reported below, in one line with what was moved
    has_ckpts = (Path(out) / "checkpoints").is_dir()
    ckpts = Checkpoints(out, create=False, log=quiet, mesh=resolve_mesh(tc)) if has_ckpts else None
    if ckpts is None or ckpts.latest_step() is None:
        task = load_task(config, tc, data=data, corpus=corpus)
        return fit_config(config, task, vocab_size), with_epochs(tc, task), task, None
    saved_config, saved_tc, state, meta = ckpts.restore()  # the newest intact step
    if ckpts.damaged:  # newer, damaged steps: moved aside (kept for inspection), so training can save again
        moved = ", ".join(ckpts.set_aside(e.step).name for e in ckpts.damaged)
        warn(f"{damage_summary(ckpts.dir, ckpts.damaged)}; resuming from step {int(state.step)}, the newest intact "
              f"one (moved aside: {moved})")
    ckpts.close()
    task = load_task(saved_config, saved_tc, data=data, corpus=corpus, tokenizer=meta["tokenizer"])
    diffs = _differences(fit_config(config, task, vocab_size), saved_config) + _differences(with_epochs(tc, task), saved_tc)
    if task.source != meta["source"]:
        diffs.append(f"data={task.source!r} (saved: {meta['source']!r})")
    if diffs:
        raise ValueError(f"{out} holds a run with other settings; to resume, drop the changes "
                         f"({'; '.join(diffs)}), or train into a new --out directory")
    state = to_execution(saved_config, state, saved_tc.execution, tc.execution)
    return saved_config, saved_tc.replace(**{k: getattr(tc, k) for k in ENGINE}), task, state


class NonFiniteLoss(FloatingPointError):
    """Training met a NaN/inf loss, gradient norm or weight with ``on_nonfinite='stop'``."""


def evaluate(config, params, batches: list[dict], eval_step=None, place=None, execution=None) -> dict:
    """Token-mean loss, perplexity and accuracy over ``batches`` (no dropout). ``place``: puts a
    host batch on the mesh the params live on (``fit`` passes it when training sharded);
    ``execution``: the Execution the params' layout is for (None: the default)."""
    eval_step = eval_step or make_eval_step(config, execution=execution)
    put = (lambda b: b) if place is None else (lambda b: place(b, lead=0))
    sums = [eval_step(params, put(check_batch(b, config))) for b in batches]  # host-side: jit would not raise
    loss_sum, count, correct = (float(sum(s[k] for s in jax.device_get(sums))) for k in ("loss_sum", "count", "correct"))
    loss = loss_sum / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_accuracy": correct / max(count, 1)}


_all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))


def _value(x):
    """A fetched metric as JSON: a float, or a list (a vector metric, e.g. MoE's expert_load)."""
    return float(x) if np.ndim(x) == 0 else np.asarray(x, float).tolist()


def _read_metrics(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def fit(config, tc: TrainConfig, task: Task, out: str | Path | None = None, *, state: TrainState | None = None,
        progress: bool = True, log=print, checkpoints: bool = True, until: int | None = None,
        on_log: Callable[[list[dict]], bool | None] | None = None,
        on_eval: Callable[[int, Any], dict] | None = None, train_steps=None, eval_step=None,
        loggers: tuple[Callable[[list[dict]], None], ...] = ()) -> dict:
    """Train from ``state`` (default: ``init_state``) to ``tc.steps``, writing ``out/metrics.jsonl``,
    ``out/checkpoints/`` and ``out/loss.png``. Every batch is checked on the host, and a NaN/inf loss
    stops the run (``tc.on_nonfinite``).

    checkpoints: False: no orbax and no checkpoints/ folder; ``out`` is then optional (None: nothing
    is written). until: stop after that many updates (the schedule still spans ``tc.steps``).
    on_log(rows): called with the training rows each time they are fetched (every ``tc.log_every``
    steps, and the first step), after the NaN check; a true result stops the run after that step
    (saved when checkpointing; no extra evaluation). on_eval(step, params) -> dict: scores merged into
    each evaluation row (every ``tc.eval_every`` steps and at the end; also without a validation
    split). train_steps, eval_step: compiled programs to reuse (``make_train_steps(config, tc,
    tc.updates_per_call)``, ``make_eval_step(config)``), e.g. across the seeds of one model. loggers: callables given every
    row metrics.jsonl gets, on process 0 (``jaxgpt.train.tensorboard.TensorBoardLog``).

    Returns the summary: steps (updates done), final_loss (mean of the last 20), val_loss, tok_s,
    skipped, plot; the timing, defined once: compile_s = the first update of this call (tracing,
    compiling and running it), train_s = the wall time of the other updates (steady state:
    evaluation, callbacks and checkpoint saves excluded), ms_per_step = median over the log windows,
    tok_s = tokens per second at that median; history = every metrics row (what metrics.jsonl
    holds); state = the final TrainState."""
    if out is None and checkpoints:
        raise ValueError("fit with checkpoints saves into a run directory: give out, or pass checkpoints=False")
    use_host_devices()  # one CPU device per core when JAX has not started yet (jaxgpt.parallel.host_devices)
    out = None if out is None else Path(out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(config, tc, task, train_steps=train_steps, eval_step=eval_step)  # the mesh: decided here, once
    run = _Run(config, tc, task, plan, out, checkpoints=checkpoints, progress=progress,
               hooks=_Hooks(on_log=on_log, on_eval=on_eval, loggers=loggers))
    try:
        run.start(state, until)
        run.train()
    finally:
        run.close()
    return run.summary(log)


class _Hooks:
    """The caller's callbacks: ``loggers`` get every metrics row (process 0); ``on_log(rows)`` each fetch
    of training rows (a true result stops the run); ``on_eval(step, params)`` scores for eval rows."""

    def __init__(self, on_log=None, on_eval=None, loggers=()):
        self.on_log, self.on_eval, self.loggers = on_log, on_eval, tuple(loggers)


class _Run:
    """One ``fit``: the loop's state (history, metrics still on the device, timing), and its steps:
    dispatch the calls, fetch and record metrics (a NaN stops here), evaluate, save."""

    def __init__(self, config, tc: TrainConfig, task: Task, plan: Plan, out: Path | None, *, checkpoints: bool,
                 progress: bool, hooks: _Hooks):
        self.config, self.tc, self.task, self.plan, self.out, self.hooks = config, tc, task, plan, out, hooks
        self.ckpts = Checkpoints(out, keep=tc.keep, mesh=plan.mesh) if checkpoints else None
        self.meta = None if self.ckpts is None else {  # saved with each step
            "config": config.to_dict(), "train": tc.to_dict(), "tokenizer": task.tokenizer.to_dict(),
            "source": task.source, "kind": task.kind}
        self.metrics_path = None if out is None else out / "metrics.jsonl"
        self.eval_batches = task.eval_batches(tc)
        self.tokens = task.tokens_per_step(tc)
        self.progress = progress
        self.pending: list[tuple[range, dict]] = []  # (the updates of a call, their metrics still on the device)
        self.compile_s, self.train_s, self.windows = None, 0.0, []  # windows: seconds per step, steady state
        self.stop_requested = False

    def start(self, state: TrainState | None, until: int | None) -> None:
        """The state to train (initialised, or placed on the mesh), the history up to it, the range of updates."""
        plan = self.plan
        if state is None:
            state = init_state(self.config, self.tc, mesh=plan.mesh)  # with a mesh: created in its sharding
        elif plan.mesh is not None:  # restored or --init weights: split over the mesh (a no-op when already placed)
            from jaxgpt.parallel.sharding import state_shardings

            state = jax.device_put(state, state_shardings(self.config, state, plan.mesh))
        self.state, self.start_step = state, int(state.step)
        self.end = self.tc.steps if until is None else min(until, self.tc.steps)
        for s in self.ckpts.steps() if self.ckpts is not None else ():
            if s > self.start_step:  # damaged steps the resume skipped: out of the way, but not deleted
                warn(f"checkpoint step {s} is newer than the starting step {self.start_step}: moved to "
                     f"{self.ckpts.set_aside(s)}")
        # drop lines written after the checkpoint
        self.history = _read_metrics(self.metrics_path, self.start_step) if self.metrics_path else []
        if self.metrics_path and is_primary():  # multi-host: process 0 writes the run's files; the others read them
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            tmp.replace(self.metrics_path)  # atomic: a process reading it meanwhile sees the old lines or the new
        self.skipped = sum(1 for r in self.history if r.get("nonfinite"))
        self.bar = Progress(self.end, enabled=self.progress)
        self.t_flush = time.perf_counter()  # compile_s counts from here: waiting for the compile-ahead thread too
        if plan.ahead is not None:  # meanwhile, what the first save runs, into the persistent cache too
            _all_finite.lower(plan.abstract.params).compile()
            if self.ckpts is not None:
                self.ckpts.compile_ahead(plan.abstract)
            plan.ahead.join()  # the first call loads what the thread compiled

    def record(self, rows: list[dict]) -> None:
        if self.metrics_path and is_primary():
            with self.metrics_path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if is_primary():
            for logger in self.hooks.loggers:
                logger(rows)
        self.history.extend(rows)

    def nonfinite(self, what: str) -> NonFiniteLoss:
        last = None if self.ckpts is None else self.ckpts.latest_step()
        kept = f"the last checkpoint, step {last}, holds finite weights" if last is not None else \
            "no checkpoint saved" if self.ckpts is not None else "no checkpoints kept (checkpoints=False)"
        return NonFiniteLoss(f"{what}; training stopped without saving it ({kept}). Lower lr (now {self.tc.lr:g}) "
                             "or add warmup, or set on_nonfinite=skip to skip such updates")

    def flush(self, step: int, timed: bool = True) -> None:
        """Fetch the pending metrics (a NaN stops here); timed: the window since the last fetch is steady state."""
        calls, metrics = zip(*self.pending)
        # the fetch waits for the pending updates: dispatch runs ahead of the device, so their compute
        # belongs to the window (timed before the fetch, a run reads faster than it is)
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        n = sum(len(c) for c in calls)
        if timed:
            self.train_s += now - self.t_flush
            self.windows.append((now - self.t_flush) / n)
        tok_s = self.tokens * n / max(now - self.t_flush, 1e-9)
        rows = [{"step": s, **{k: _value(v[i]) for k, v in m.items()}, "tok_s": round(tok_s, 1)}
                for c, m in zip(calls, metrics) for i, s in enumerate(c)]
        self.pending.clear()
        bad = [r for r in rows if r["nonfinite"]]
        for r in rows:  # written only where it happened
            if not r["nonfinite"]:
                del r["nonfinite"]
        if bad and self.tc.on_nonfinite == "stop":
            self.record(rows[:rows.index(bad[0]) + 1])  # the bad step is logged, nothing after it
            r = bad[0]
            what = "loss" if not math.isfinite(r["loss"]) else "gradient"
            raise self.nonfinite(f"non-finite {what} at step {r['step']} (loss {r['loss']:.6g}, grad norm "
                                 f"{r['grad_norm']:.6g})")
        self.record(rows)
        self.skipped += len(bad)
        self.bar.update(step, self.history[-1]["loss"], tok_s, f", {self.skipped} skipped" if self.skipped else "")
        if self.hooks.on_log is not None and self.hooks.on_log(rows):
            self.stop_requested = True
        self.t_flush = time.perf_counter()  # the fetch and the callback are not training time

    def save(self) -> None:
        if self.pending:  # a NaN in the unflushed steps must stop the save
            self.flush(int(self.state.step))
        if self.ckpts is None or self.ckpts.latest_step() == int(self.state.step):
            return  # without checkpoints the weights are still checked at the end
        if not bool(_all_finite(self.state.params)):
            raise self.nonfinite(f"the weights hold NaN/inf at step {int(self.state.step)} (the update overflowed)")
        self.ckpts.save(self.state, self.meta)

    def calls(self) -> list[range]:
        """The updates of each call: the first alone (it compiles), then up to ``k`` at a time, each call
        ending where the loop logs, evaluates or saves."""
        tc, out, s = self.tc, [], self.start_step
        while s < self.end:
            stops = [self.end, s + 1 if s == self.start_step else s + self.plan.k]
            every = (tc.log_every, tc.eval_every, tc.ckpt_every if self.ckpts is not None else 0)
            stops += [(s // e + 1) * e for e in every if e]
            out.append(range(s + 1, min(stops) + 1))  # the step counts after each update
            s = min(stops)
        return out

    def batches_of(self, c: range) -> dict:
        """Call ``c``'s batches, ``k`` stacked (k, ...), the slots after its last update repeating that
        update's batch (a pure function of the step: the prefetch thread builds them)."""
        got = [self.task.batch(self.tc, s - 1) for s in c]
        got += got[-1:] * (self.plan.k - len(got))
        return {key: np.stack([b[key] for b in got]) for key in got[0]}

    def evaluate(self, step: int) -> None:
        row = {"step": step}
        if self.eval_batches:
            place = None if self.plan.mesh is None else self.plan.place
            row |= evaluate(self.config, self.state.params, self.eval_batches, self.plan.eval_step, place)
        self.record([row | (self.hooks.on_eval(step, self.state.params) if self.hooks.on_eval else {})])

    def train(self) -> None:
        tc, plan = self.tc, self.plan
        work = self.calls()
        # host-side prefetch: a thread builds the next batches (pure functions of the step) while the device runs
        self.prefetch = Prefetch(self.batches_of, work, depth=PREFETCH_DEPTH)
        try:
            for c in work:
                # dispatch is asynchronous: the thread is already building the batches after these
                chunk = check_batch(self.prefetch.get(c), self.config)  # jit would not raise
                self.state, m = plan.run(self.state, chunk, len(c))
                done = c[-1]
                self.pending.append((c, m))
                evaluate_now = (tc.eval_every and done % tc.eval_every == 0) or done == self.end
                save_now = self.ckpts is not None and ((tc.ckpt_every and done % tc.ckpt_every == 0)
                                                       or done == self.end)
                if c[0] == self.start_step + 1:  # this call's first update traces and compiles: timed apart
                    jax.block_until_ready(m)
                    self.compile_s = time.perf_counter() - self.t_flush
                    self.flush(done, timed=False)
                elif done % tc.log_every == 0 or evaluate_now:
                    self.flush(done)  # before evaluating (and save() flushes first): a NaN is seen before either
                if evaluate_now and (self.eval_batches or self.hooks.on_eval):  # val_fraction=0: nothing to evaluate
                    self.evaluate(done)
                if save_now:
                    self.save()
                if evaluate_now or save_now:
                    self.t_flush = time.perf_counter()  # steady-state timing leaves evaluation and saving out
                if self.stop_requested:
                    break
        except KeyboardInterrupt:
            self.save()
            raise
        self.save()
        if self.ckpts is None and not bool(_all_finite(self.state.params)):  # what a save would have refused
            raise self.nonfinite(f"the weights hold NaN/inf at step {int(self.state.step)} (the update overflowed)")

    def close(self) -> None:
        if getattr(self, "prefetch", None) is not None:
            self.prefetch.close()
        if getattr(self, "bar", None) is not None:
            self.bar.close()
        if self.ckpts is not None:
            self.ckpts.wait()  # the last save: finished, read back, older steps pruned
            self.ckpts.close()

    def summary(self, log) -> dict:
        history = self.history
        train_rows = [r for r in history if "loss" in r and not r.get("nonfinite")]  # skipped: not in the means
        val_rows = [r for r in history if "val_loss" in r]
        ms = 1e3 * float(np.median(self.windows)) if self.windows else None
        summary = {"steps": int(self.state.step),
                   "final_loss": float(np.mean([r["loss"] for r in train_rows[-20:]])) if train_rows else None,
                   "val_loss": val_rows[-1]["val_loss"] if val_rows else None,
                   "tok_s": self.tokens * 1e3 / ms if ms else None, "skipped": self.skipped,
                   "compile_s": self.compile_s, "train_s": self.train_s, "ms_per_step": ms}
        plot = None
        if self.out is not None and is_primary():
            plot = plot_losses(history, self.out / "loss.png", title=f"{self.task.source}")
            if plot is None:
                log("matplotlib is not installed: skipped loss.png (pip install 'jaxgpt[plots]')")
            elif any("expert_load" in r for r in history):  # MoE: each expert's share of the picks
                plot_expert_load(history, self.out / "expert_load.png", title=f"{self.task.source}")
        return summary | {"plot": str(plot) if plot else None, "history": history, "state": self.state}


__all__ = ["NonFiniteLoss", "Progress", "evaluate", "fit", "plot_losses", "prepare"]
