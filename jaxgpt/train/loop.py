"""The training loop behind ``jaxgpt train`` and every experiment in scripts/experiments: resume,
step, log, evaluate, checkpoint, plot (``fit(checkpoints=False)``: no orbax, no run directory needed).

Updates run ``TrainConfig.steps_per_call`` at a time (default: ``log_every``): one call of
``make_train_steps`` loops over a stack of batches inside the program, so a CPU host whose cores
all run the step spends its time on one dispatch, one transfer and one fetch per call, not per
update (nanoGPT's CPU run: 26 -> 23 ms an update). The batches are built ahead by a prefetch
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
from jaxgpt.train.checkpoint import Checkpoints, damage_summary, warn
from jaxgpt.parallel.hosts import barrier, is_primary
from jaxgpt.train.step import (TrainState, abstract_state, compile_ahead, init_state, make_eval_step,
                               make_train_step, make_train_steps)
from jaxgpt.train.tasks import Task, fit_config, load_task, with_epochs
from jaxgpt.core.validate import check_batch


PREFETCH_DEPTH = 2  # batches built ahead of the device (host memory: depth x one batch)
ENGINE = ("mesh", "steps_per_call")  # TrainConfig fields a run may change when it resumes: not math


def _differences(a, b) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}={da[k]!r} (saved: {db[k]!r})" for k in da if da[k] != db[k] and k not in ENGINE]


def _mesh(tc: TrainConfig):
    """The jax Mesh of ``tc.mesh`` (None: the single-device path, unchanged; 'auto': sharding.auto_mesh)."""
    if not tc.mesh:
        return None
    from jaxgpt.parallel.sharding import train_mesh

    return train_mesh(tc)


def prepare(out: str | Path, config, tc: TrainConfig, *, data: str | None = None, corpus: str | None = None,
            vocab_size: int | None = None) -> tuple[object, TrainConfig, Task, TrainState | None]:
    """Model config, TrainConfig, task and the state to resume from (None: a fresh run).

    A fresh run sizes ``config``'s vocabulary to the data's tokenizer (``vocab_size``: a padded table of
    that many rows instead, ``fit_config``). When ``out`` holds a
    checkpoint the run resumes with the saved tokenizer, and any difference between the given and
    the saved configs (or data) is an error: resuming is exact or it does not happen.
    """
    # Multi-host: every process looks for checkpoints before any of them starts fit (which creates the
    # directory), so they all agree on fresh run vs resume and open orbax the same number of times.
    barrier("jaxgpt prepare")
    quiet = lambda _: None  # the fallback is reported below, in one line with what was moved
    has_ckpts = (Path(out) / "checkpoints").is_dir()
    ckpts = Checkpoints(out, create=False, log=quiet, mesh=_mesh(tc)) if has_ckpts else None
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
    return saved_config, saved_tc.replace(**{k: getattr(tc, k) for k in ENGINE}), task, state


class NonFiniteLoss(FloatingPointError):
    """Training met a NaN/inf loss, gradient norm or weight with ``on_nonfinite='stop'``."""


def _placer(mesh):
    """Host batch -> global arrays on ``mesh``, rows split over ('data', 'fsdp', 'expert'), each
    process handing over its own rows: ``lead`` axes before the rows (``sharding.batch_sharding``:
    2 for a chunk of train batches, 1 for one). Eval batches (``lead=0``) too when their rows divide,
    else replicated (a short last batch of a classification set)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.config.mesh import batch_devices
    from jaxgpt.parallel.sharding import shard_batch

    rows = batch_devices(mesh.shape)

    def place(batch: dict, lead: int) -> dict:
        if lead or all(len(x) % rows == 0 for x in batch.values()):
            return shard_batch(batch, mesh, lead)
        whole = NamedSharding(mesh, PartitionSpec())
        return {k: jax.make_array_from_process_local_data(whole, np.asarray(x)) for k, x in batch.items()}

    return place


def _chunk_shapes(task: Task, tc: TrainConfig, k: int, mesh) -> dict:
    """Shapes of a call's stacked batches, (k, grad_accum, micro_batch, ...), as ``fit`` places them."""
    sharding = None
    if mesh is not None:
        from jaxgpt.parallel.sharding import batch_sharding

        sharding = batch_sharding(mesh, lead=2)
    return {key: jax.ShapeDtypeStruct((k, *np.shape(x)), np.asarray(x).dtype, sharding=sharding)
            for key, x in task.batch(tc, 0).items()}


def evaluate(config, params, batches: list[dict], eval_step=None, place=None) -> dict:
    """Token-mean loss, perplexity and accuracy over ``batches`` (no dropout). ``place``: puts a
    host batch on the mesh the params live on (``fit`` passes it when training sharded)."""
    eval_step = eval_step or make_eval_step(config)
    put = (lambda b: b) if place is None else (lambda b: place(b, lead=0))
    sums = [eval_step(params, put(check_batch(b, config))) for b in batches]  # host-side: jit would not raise
    loss_sum, count, correct = (float(sum(s[k] for s in jax.device_get(sums))) for k in ("loss_sum", "count", "correct"))
    loss = loss_sum / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_accuracy": correct / max(count, 1)}


_all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))


def _read_metrics(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def fit(config, tc: TrainConfig, task: Task, out: str | Path | None = None, *, state: TrainState | None = None,
        progress: bool = True, log=print, checkpoints: bool = True, until: int | None = None,
        on_log: Callable[[list[dict]], bool | None] | None = None,
        on_eval: Callable[[int, Any], dict] | None = None, train_step=None, eval_step=None,
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
    split). train_step, eval_step: compiled steps to reuse (``make_train_step(config, tc)``,
    ``make_eval_step(config)``), e.g. across the seeds of one model. loggers: callables given every
    row metrics.jsonl gets, on process 0 (``jaxgpt.train.tensorboard.TensorBoardLog``).

    Returns the summary: steps (updates done), final_loss (mean of the last 20), val_loss, tok_s,
    skipped, plot; the timing, defined once: compile_s = the first update of this call (tracing,
    compiling and running it), train_s = the wall time of the other updates (steady state:
    evaluation, callbacks and checkpoint saves excluded), ms_per_step = median over the log windows,
    tok_s = tokens per second at that median; history = every metrics row (what metrics.jsonl
    holds); state = the final TrainState."""
    if out is None and checkpoints:
        raise ValueError("fit with checkpoints saves into a run directory: give out, or pass checkpoints=False")
    out = None if out is None else Path(out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    mesh = _mesh(tc)
    ckpts = Checkpoints(out, keep=tc.keep, mesh=mesh) if checkpoints else None
    # several updates per call (make_train_steps) unless the caller brought its own one-update step
    k = 1 if train_step is not None else tc.updates_per_call
    multi = k > 1
    ahead = None
    if multi:  # compiled on a thread while the state is initialised (with a persistent cache)
        train_steps = make_train_steps(config, tc, k, mesh=mesh)
        abstract = abstract_state(config, tc, mesh)
        ahead = compile_ahead(train_steps, abstract, _chunk_shapes(task, tc, k, mesh), jax.ShapeDtypeStruct((), np.int32))
    else:
        train_step = train_step or make_train_step(config, tc, mesh=mesh)
    if state is None:
        state = init_state(config, tc, mesh=mesh)  # with a mesh: created in its sharding
    elif mesh is not None:  # restored or --init weights: split over the mesh (a no-op when already placed)
        from jaxgpt.parallel.sharding import state_shardings

        state = jax.device_put(state, state_shardings(config, state, mesh))
    place = (lambda b, lead: b) if mesh is None else _placer(mesh)
    start = int(state.step)
    end = tc.steps if until is None else min(until, tc.steps)
    for s in ckpts.steps() if ckpts is not None else ():
        if s > start:  # damaged steps the resume skipped: out of the way, but not deleted
            warn(f"checkpoint step {s} is newer than the starting step {start}: moved to {ckpts.set_aside(s)}")
    metrics_path = None if out is None else out / "metrics.jsonl"
    history = _read_metrics(metrics_path, start) if metrics_path else []  # drop lines written after the checkpoint
    if metrics_path and is_primary():  # multi-host: process 0 writes the run's files; the others read them
        tmp = metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
        tmp.replace(metrics_path)  # atomic: a process reading it meanwhile sees the old lines or the new ones
    meta = None if ckpts is None else {  # saved with each step
        "config": config.to_dict(), "train": tc.to_dict(), "tokenizer": task.tokenizer.to_dict(), "source": task.source,
        "kind": task.kind}
    eval_step = eval_step or make_eval_step(config, mesh=mesh)
    eval_batches = task.eval_batches(tc)
    bar = Progress(end, enabled=progress)
    tokens = task.tokens_per_step(tc)
    pending: list[tuple[range, dict]] = []  # (the updates of a call, their metrics still on the device)
    t_flush = time.perf_counter()
    compile_s, train_s, windows, stop_requested = None, 0.0, [], False  # windows: seconds per step, steady state
    skipped = sum(1 for r in history if r.get("nonfinite"))

    def record(rows: list[dict]) -> None:
        if metrics_path and is_primary():
            with metrics_path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if is_primary():
            for logger in loggers:
                logger(rows)
        history.extend(rows)

    def stop(what: str) -> NonFiniteLoss:
        last = None if ckpts is None else ckpts.latest_step()
        kept = f"the last checkpoint, step {last}, holds finite weights" if last is not None else \
            "no checkpoint saved" if ckpts is not None else "no checkpoints kept (checkpoints=False)"
        return NonFiniteLoss(f"{what}; training stopped without saving it ({kept}). Lower lr (now {tc.lr:g}) or "
                             "add warmup, or set on_nonfinite=skip to skip such updates")

    def flush(step: int, timed: bool = True) -> None:
        """Fetch the pending metrics (a NaN stops here); timed: the window since the last fetch is steady state."""
        nonlocal t_flush, skipped, train_s, stop_requested
        calls, metrics = zip(*pending)
        # the fetch waits for the pending updates: dispatch runs ahead of the device, so their compute
        # belongs to the window (timed before the fetch, a 1-device run on the CPU read 2x too fast)
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        n = sum(len(c) for c in calls)
        if timed:
            train_s += now - t_flush
            windows.append((now - t_flush) / n)
        tok_s = tokens * n / max(now - t_flush, 1e-9)
        rows = [{"step": s, **{k: float(v[i] if multi else v) for k, v in m.items()}, "tok_s": round(tok_s, 1)}
                for c, m in zip(calls, metrics) for i, s in enumerate(c)]
        pending.clear()
        bad = [r for r in rows if r["nonfinite"]]
        for r in rows:  # written only where it happened
            if not r["nonfinite"]:
                del r["nonfinite"]
        if bad and tc.on_nonfinite == "stop":
            record(rows[:rows.index(bad[0]) + 1])  # the bad step is logged, nothing after it
            r = bad[0]
            what = "loss" if not math.isfinite(r["loss"]) else "gradient"
            raise stop(f"non-finite {what} at step {r['step']} (loss {r['loss']:.6g}, grad norm {r['grad_norm']:.6g})")
        record(rows)
        skipped += len(bad)
        bar.update(step, history[-1]["loss"], tok_s, f", {skipped} skipped" if skipped else "")
        if on_log is not None and on_log(rows):
            stop_requested = True
        t_flush = time.perf_counter()  # the fetch and the callback are not training time

    def save() -> None:
        if pending:  # a NaN in the unflushed steps must stop the save
            flush(int(state.step))
        if ckpts is None:  # nothing saved; the weights are still checked at the end
            return
        if ckpts.latest_step() == int(state.step):
            return
        if not bool(_all_finite(state.params)):
            raise stop(f"the weights hold NaN/inf at step {int(state.step)} (the update overflowed)")
        ckpts.save(state, meta)

    def calls() -> list[range]:
        """The updates of each call: the first alone (it compiles), then up to ``k`` at a time, each call
        ending where the loop logs, evaluates or saves."""
        out, s = [], start
        while s < end:
            stops = [end, s + 1 if s == start else s + k]
            every = (tc.log_every, tc.eval_every, tc.ckpt_every if ckpts is not None else 0)
            stops += [(s // e + 1) * e for e in every if e]
            out.append(range(s + 1, min(stops) + 1))  # the step counts after each update
            s = min(stops)
        return out

    def chunk(c: range) -> dict:
        """The batches of call ``c`` stacked, (k, ...): the slots after the last update repeat its batch."""
        got = [task.batch(tc, s - 1) for s in c]
        got += got[-1:] * (k - len(got))
        return {key: np.stack([b[key] for b in got]) for key in got[0]}

    if ahead is not None:  # meanwhile, what the first save runs, into the persistent cache too
        _all_finite.lower(abstract.params).compile()
        if ckpts is not None:
            ckpts.compile_ahead(abstract)
        ahead.join()  # the first call loads what the thread compiled
    # host-side prefetch: a thread builds the next batches (pure functions of the step) while the device runs
    work = calls()
    batches = Prefetch(chunk if multi else (lambda c: task.batch(tc, c[0] - 1)), work, depth=PREFETCH_DEPTH)
    lead = 2 if multi else 1  # axes before the batch rows: (k, A, B, ...) or (A, B, ...)
    try:
        try:
            for c in work:
                # dispatch is asynchronous: the thread is already building the batches after these
                b = place(check_batch(batches.get(c), config), lead)  # jit would not raise
                state, m = train_steps(state, b, np.int32(len(c))) if multi else train_step(state, b)
                done = c[-1]
                pending.append((c, m))
                evaluate_now = (tc.eval_every and done % tc.eval_every == 0) or done == end
                save_now = ckpts is not None and ((tc.ckpt_every and done % tc.ckpt_every == 0) or done == end)
                if c[0] == start + 1:  # this call's first update traces and compiles: timed apart, fetched at once
                    jax.block_until_ready(m)
                    compile_s = time.perf_counter() - t_flush
                    flush(done, timed=False)
                elif done % tc.log_every == 0 or evaluate_now:
                    flush(done)  # before evaluating (and save() flushes first): a NaN is seen before either
                if evaluate_now and (eval_batches or on_eval):  # val_fraction=0: nothing to evaluate on
                    row = {"step": done}
                    if eval_batches:
                        row |= evaluate(config, state.params, eval_batches, eval_step, None if mesh is None else place)
                    record([row | (on_eval(done, state.params) if on_eval else {})])
                if save_now:
                    save()
                if evaluate_now or save_now:
                    t_flush = time.perf_counter()  # steady-state timing leaves evaluation and saving out
                if stop_requested:
                    break
        except KeyboardInterrupt:
            save()
            raise
        save()
        if ckpts is None and not bool(_all_finite(state.params)):  # what a save would have refused
            raise stop(f"the weights hold NaN/inf at step {int(state.step)} (the update overflowed)")
    finally:
        batches.close()
        bar.close()
        if ckpts is not None:
            ckpts.wait()  # the last save: finished, read back, older steps pruned
            ckpts.close()
    train_rows = [r for r in history if "loss" in r and not r.get("nonfinite")]  # skipped updates: not in the means
    val_rows = [r for r in history if "val_loss" in r]
    ms = 1e3 * float(np.median(windows)) if windows else None
    summary = {"steps": int(state.step),
               "final_loss": float(np.mean([r["loss"] for r in train_rows[-20:]])) if train_rows else None,
               "val_loss": val_rows[-1]["val_loss"] if val_rows else None,
               "tok_s": tokens * 1e3 / ms if ms else None, "skipped": skipped,
               "compile_s": compile_s, "train_s": train_s, "ms_per_step": ms}
    plot = None
    if out is not None and is_primary():
        plot = plot_losses(history, out / "loss.png", title=f"{task.source}")
        if plot is None:
            log("matplotlib is not installed: skipped loss.png (pip install 'jaxgpt[plots]')")
    return summary | {"plot": str(plot) if plot else None, "history": history, "state": state}


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


__all__ = ["NonFiniteLoss", "Progress", "evaluate", "fit", "plot_losses", "prepare"]
