"""Orbax checkpoints: ``DIR/checkpoints/<step>/{params, train, meta}``, checked on the way in.

``params`` and ``train`` (step, optimizer state, rng) are separate items so that sampling and
evaluation restore the weights alone; ``meta`` is JSON (model config, training config,
tokenizer, data source, and a checksum of every array). Restores go into abstract targets from
``jax.eval_shape``, so nothing is allocated twice and a shape mismatch is an error, not a silent
reshape.

Damage: orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it when complete,
so a killed save leaves no half step behind. Files damaged later (a truncated array, garbage
JSON, flipped bytes: zstd-compressed zarr chunks can decode to wrong numbers without an error)
are caught at restore, as unreadable or as a checksum mismatch, and reported as
``DamagedCheckpoint`` naming the step and the item. Restoring "the latest" falls back to the
newest intact step and says so in one line. Old steps are pruned here, not by orbax's
``max_to_keep``, and only once ``keep`` newer steps have been read back intact, so the last good
checkpoint is never deleted while a newer one is unverified.

Multi-host (``jax.distributed``, a directory every process sees): every process calls ``save``,
``wait``, ``restore`` and ``set_aside``. Orbax needs that: each process writes and reads its own
shards, its save/delete hold barriers, and its process 0 renames the finished step into place and
deletes. What jaxgpt itself writes (the file table, a step moved aside) is written by process 0
alone (``jaxgpt.parallel.hosts``); every process reads each save back, since the checksums are
computed over the global arrays.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxgpt.config import Execution, TrainConfig, config_from_dict, split_execution
from jaxgpt.models import abstract_params, relayout
from jaxgpt.parallel.hosts import barrier, is_primary
from jaxgpt.train.step import TrainState, abstract_state

FORMAT = "jaxgpt-checkpoint/1"
ITEMS = ("params", "train", "meta")
FILES = "jaxgpt_files.json"  # <step>/FILES: size and sha256 of every file, written once the step is read back


class DamagedCheckpoint(ValueError):
    """A checkpoint step whose ``item`` (params / train / meta) cannot be used."""

    def __init__(self, directory: Path, step: int, item: str, reason: str, hint: str = ""):
        self.directory, self.step, self.item, self.reason = directory, step, item, reason
        super().__init__(f"checkpoint step {step} in {str(directory)!r} is damaged: {item} {reason}{hint}")


def damage_summary(directory: Path, damaged: list[DamagedCheckpoint]) -> str:
    """One line: which steps of ``directory`` are damaged, in which item, and why."""
    details = "; ".join(f"step {e.step}: {e.item} {e.reason}" for e in damaged)
    return f"damaged checkpoint{'s' if len(damaged) > 1 else ''} in {str(directory)!r} ({details})"


def _short(e: BaseException, limit: int = 200) -> str:
    """The innermost cause of a restore error in one line: TensorStore appends kilobytes of spec."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split("See full TensorStore details")[0].split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fingerprint(x: jax.Array) -> jax.Array:
    """() uint32: sum of the array's bit patterns times odd position weights, mod 2**32. Integer
    arithmetic, so any order of summation gives the same value; catches flipped and moved bytes."""
    x = jnp.asarray(x)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()  # 8-byte: (..., 2) -> ravel
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def _train_items(state) -> dict:
    """What a checkpoint's 'train' item holds: everything of the state but the params."""
    return {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}


def saved_configs(meta: dict) -> tuple[object, TrainConfig]:
    """(model config, TrainConfig) of a checkpoint's meta. One saved before Execution left the model
    config holds its execution keys in the config: they become ``TrainConfig.execution``."""
    arch, old = split_execution(meta["config"])
    train = meta["train"] if not old or "execution" in meta["train"] else {**meta["train"], "execution": old}
    return config_from_dict(arch), TrainConfig.from_dict(train)


def to_execution(config, tree, saved: Execution | None, wanted: Execution | None):
    """``tree`` (params, a TrainState) saved under ``saved`` in the params layout ``wanted`` runs
    (the layer stacks stacked or separate: ``Execution.scan_layers``; None: ``Execution.for_model``);
    unchanged where they agree."""
    saved, wanted = Execution.for_model(config, saved), Execution.for_model(config, wanted)
    if saved.scan_layers == wanted.scan_layers:
        return tree
    if isinstance(tree, TrainState):
        return tree.replace(params=to_execution(config, tree.params, saved, wanted),
                            opt_state=to_execution(config, tree.opt_state, saved, wanted))
    return relayout(tree, config, scanned=wanted.scan_layers, stack=jnp.stack)


def checksums(tree) -> dict[str, int]:
    """{'['layers']['mlp']...': uint32 checksum} for every array of ``tree`` (computed on the device)."""
    sums = jax.device_get(_fingerprints(tree))
    return {jax.tree_util.keystr(path): int(v) for path, v in jax.tree_util.tree_leaves_with_path(sums)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_table(step_dir: Path) -> dict[str, list]:
    """{'params/d/ab12..': [size, sha256]} for every file under the item directories."""
    return {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _sha256(p)]
            for item in ITEMS for p in sorted((step_dir / item).rglob("*")) if p.is_file()}


_quiet_installed = False


def _quiet_abandoned_reads() -> None:
    """After a failed orbax read, the other reads of that restore finish on a closed event loop
    and print pages of 'Event loop is closed' / 'Exception ignored in: <coroutine ...>'. Drop
    exactly those (the failure itself was reported in one line); everything else passes through."""
    global _quiet_installed
    if _quiet_installed:
        return
    _quiet_installed = True
    unraisable, excepthook, thread_hook = sys.unraisablehook, sys.excepthook, threading.excepthook

    def abandoned(exc) -> bool:
        return (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)) or \
            "Encountered error while reading array index" in str(exc)

    sys.unraisablehook = lambda u: None if abandoned(u.exc_value) else unraisable(u)
    sys.excepthook = lambda t, v, tb: None if abandoned(v) else excepthook(t, v, tb)
    threading.excepthook = lambda a: None if abandoned(a.exc_value) else thread_hook(a)


def checkpoint_dir(path: str | Path, create: bool = False) -> Path:
    """``path/checkpoints`` for a run directory; an existing checkpoints directory as it is."""
    p = Path(path).absolute()
    return p / "checkpoints" if create or (p / "checkpoints").is_dir() else p


def warn(message: str) -> None:
    """One line on stderr: ``jaxgpt: warning: ...``."""
    print(f"jaxgpt: warning: {message}", file=sys.stderr, flush=True)


class Checkpoints:
    """Save every N steps, keep the last K verified ones, restore the latest intact (or a given) step.

    ``log`` receives the one-line notices (fallback to an older step, a save that failed its
    read-back); default: stderr. ``mesh``: a ``jaxgpt.parallel.sharding`` mesh the restored arrays are split
    over (any mesh: a step saved on 8 devices restores onto 2, or onto one device with None).
    ``background``: read each save back on a thread while training goes on (the next ``save`` or
    ``wait`` joins it); None (default): in a single-process run. Multi-host runs read back in
    ``wait``, where every process is: orbax's reads may hold barriers, which must not interleave with
    the train step's collectives. (docs/performance.md: what the thread takes off the loop.)
    """

    def __init__(self, path: str | Path, keep: int = 3, *, create: bool = True,
                 log: Callable[[str], None] | None = None, mesh=None, background: bool | None = None):
        self.dir, self.mesh = checkpoint_dir(path, create), mesh
        self.background = jax.process_count() == 1 if background is None else background
        self._reader: threading.Thread | None = None
        self._reader_error: BaseException | None = None
        if not create and not self.dir.is_dir():
            raise FileNotFoundError(f"no checkpoints at {str(path)!r} (looked in {str(self.dir)!r})")
        self.keep, self.log = keep, log or warn
        self.damaged: list[DamagedCheckpoint] = []  # what the last restore skipped
        self._verified: set[int] = set()  # read back intact by this process
        self._unverified: list[int] = []  # saved by this process, not read back yet
        # max_to_keep=None: orbax never deletes; _prune does, after verification. Opening an existing
        # directory (create=False) holds no barrier (orbax's root-metadata sync is off; it has no
        # metadata to write): multi-host processes may differ in whether they open one to look.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=create, save_root_metadata=create)
        self._mngr = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self._mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {str(self.dir)!r}; "
                                    f"saved steps: {self.steps() or 'none'}")
        return step

    # --- saving ----------------------------------------------------------------------------

    def compile_ahead(self, abstract: TrainState) -> None:
        """Compile the checksum programs ``save`` runs, for a state of ``abstract``'s shapes and
        shardings, now (``fit`` does it while the train program compiles on another thread)."""
        _fingerprints.lower(abstract.params).compile()
        _fingerprints.lower(_train_items(abstract)).compile()

    def save(self, state: TrainState, meta: dict) -> None:
        """Asynchronous: returns once the arrays are copied off the device. The previous save is
        finished, read back and pruned first."""
        self.wait()
        train = _train_items(state)
        sums = {"params": checksums(state.params), "train": checksums(train)}
        step = int(state.step)
        self._mngr.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave({"format": FORMAT, **meta, "checksums": sums})))
        self._unverified.append(step)
        if self.background:
            self._reader = threading.Thread(target=self._read_back_on_thread, name="jaxgpt-checkpoint-read-back",
                                            daemon=True)
            self._reader.start()

    def wait(self) -> None:
        """Finish pending saves, read each one back, then delete steps beyond ``keep`` verified ones."""
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        error, self._reader_error = self._reader_error, None
        if error is not None:
            raise error
        self._read_back()
        self._prune()

    def _read_back(self) -> None:
        self._mngr.wait_until_finished()  # multi-host: every process's shards are written, the step renamed
        while self._unverified:
            step = self._unverified.pop(0)
            try:
                table = _file_table(self.dir / str(step)) if is_primary() else None  # what was written...
                self._load(step, train=True)  # ...reads back intact (every process: its shards): record it
                if table is not None:
                    self._write_files(step, table)
                self._verified.add(step)
            except DamagedCheckpoint as e:
                self.log(f"{e} (right after saving it: check the disk); older checkpoints are kept")

    def _read_back_on_thread(self) -> None:
        try:
            self._read_back()
        except BaseException as e:  # noqa: BLE001  raised again in the caller's thread by wait()
            self._reader_error = e

    def _prune(self) -> None:
        """Delete every step older than the newest ``keep`` verified ones. Unverified steps
        (restored by another process, or damaged) count for nothing and are never what protects
        an older one from deletion."""
        newest_verified = [s for s in sorted(self.steps(), reverse=True) if s in self._verified][:self.keep]
        if len(newest_verified) < self.keep:
            return
        for step in self.steps():
            if step < newest_verified[-1]:
                self._mngr.delete(step)  # multi-host: called everywhere (a barrier), orbax's process 0 deletes

    def set_aside(self, step: int) -> Path:
        """Move step ``step`` out of the checkpoint list (to ``<step>.damaged``, never deleted).
        Multi-host: every process calls it; process 0 moves the directory."""
        barrier(f"jaxgpt set_aside {step}: named")  # every process picks the same free name...
        src = self.dir / str(step)
        dst = self.dir / f"{step}.damaged"
        n = 1
        while dst.exists():
            n += 1
            dst = self.dir / f"{step}.damaged{n}"
        barrier(f"jaxgpt set_aside {step}: moving")  # ...before process 0 takes it
        if is_primary():
            src.rename(dst)
        barrier(f"jaxgpt set_aside {step}: moved")
        self._mngr.reload()
        return dst

    # --- restoring -------------------------------------------------------------------------

    def _write_files(self, step: int, table: dict) -> None:
        path = self.dir / str(step) / FILES
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)  # atomic: a kill leaves the old table or none

    def _check_files(self, step: int, item: str) -> None:
        """Compare ``item``'s files with the table written when the step was verified: a
        truncated, missing or changed file is reported here, before TensorStore reads it. No
        table (older checkpoints, or killed before verification): the checksums in meta remain."""
        try:
            table = json.loads((self.dir / str(step) / FILES).read_text())
        except (OSError, ValueError):
            return
        for rel, (size, digest) in table.items():
            if not rel.startswith(item + "/"):
                continue
            p, rel = self.dir / str(step) / rel, rel.split("/", 1)[1]
            if not p.is_file():
                raise DamagedCheckpoint(self.dir, step, item, f"is missing file {rel}")
            if p.stat().st_size != size:
                raise DamagedCheckpoint(self.dir, step, item, f"file {rel} has {p.stat().st_size} bytes; "
                                        f"{size} were saved (truncated or overwritten)")
            if _sha256(p) != digest:
                raise DamagedCheckpoint(self.dir, step, item, f"file {rel} has changed since it was saved "
                                        "(sha256 differs)")

    def _meta(self, step: int) -> dict:
        self._check_files(step, "meta")
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # any failure to read the item is damage, named below
            raise DamagedCheckpoint(self.dir, step, "meta", f"is unreadable ({_short(e)})") from e
        if not isinstance(meta, dict) or "format" not in meta:
            raise DamagedCheckpoint(self.dir, step, "meta", "holds no jaxgpt checkpoint format")
        if meta["format"] != FORMAT:
            raise ValueError(f"{str(self.dir)!r} holds format {meta.get('format')!r}, expected {FORMAT!r}")
        return meta

    def _item(self, step: int, name: str, target, meta: dict):
        self._check_files(step, name)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(target)}))[name]
        except Exception as e:
            if "RESOURCE_EXHAUSTED" in str(e) or isinstance(e, MemoryError):
                raise  # out of memory is not damage
            _quiet_abandoned_reads()
            raise DamagedCheckpoint(self.dir, step, name, f"is unreadable ({_short(e)})") from e
        expected = meta.get("checksums", {}).get(name)  # absent in checkpoints written before checksums
        if expected is not None:
            got = checksums(out)
            bad = [k for k in expected if got.get(k) != expected[k]]
            if bad:
                raise DamagedCheckpoint(self.dir, step, name, f"does not match the checksums saved with it "
                                        f"({len(bad)} of {len(expected)} arrays differ, first {name}{bad[0]})")
        return out

    def _load(self, step: int, *, train: bool) -> tuple:
        """-> (config, TrainConfig, params, train dict or None, meta) of ``step``, checked."""
        meta = self._meta(step)
        try:
            config, tc = saved_configs(meta)
        except (KeyError, TypeError, ValueError) as e:
            raise DamagedCheckpoint(self.dir, step, "meta", f"holds an unusable config ({_short(e)})") from e
        if not train:
            params = self._item(step, "params", self._placed(config, abstract_params(config, tc.execution)), meta)
            return config, tc, params, None, meta
        target = self._placed(config, abstract_state(config, tc, self.mesh))
        params = self._item(step, "params", target.params, meta)
        rest = self._item(step, "train", _train_items(target), meta)
        return config, tc, params, rest, meta

    def _placed(self, config, target):
        """``target`` with a sharding on every leaf: orbax then reads each shard where it goes,
        whatever mesh wrote it (without one it would try the saving run's devices)."""
        if self.mesh is not None:
            if isinstance(target, TrainState):
                return target  # abstract_state(mesh=...) placed it
            from jaxgpt.parallel.sharding import param_shardings

            shardings = param_shardings(config, target, self.mesh)
        else:
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree.map(lambda _: one, target)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, shardings)

    def _intact(self, step: int | None, *, train: bool) -> tuple:
        """``_load`` of ``step``; of the newest intact step when ``step`` is None (saying which
        newer ones were skipped, and why, in one line)."""
        self.damaged = []
        if step is not None:
            self._step(step)
            try:
                return self._load(step, train=train)
            except DamagedCheckpoint as e:
                others = [s for s in self.steps() if s != step]
                raise DamagedCheckpoint(e.directory, e.step, e.item, e.reason,
                                        f"; other saved steps: {others or 'none'}") from e
        for s in sorted(self.steps(), reverse=True):
            try:
                out = self._load(s, train=train)
            except DamagedCheckpoint as e:
                self.damaged.append(e)
                continue
            self._verified.add(s)
            if self.damaged:
                self.log(f"{damage_summary(self.dir, self.damaged)}; using step {s}, the newest intact one")
            return out
        if not self.damaged:
            self._step(None)  # raises: no checkpoints at all
        raise ValueError(f"no intact checkpoint: {damage_summary(self.dir, self.damaged)}")

    def meta(self, step: int | None = None) -> dict:
        """The JSON item of ``step`` (default: the latest), without its checksums."""
        meta = self._meta(self._step(step))
        return {k: v for k, v in meta.items() if k != "checksums"}

    def restore(self, step: int | None = None) -> tuple[object, TrainConfig, TrainState, dict]:
        """-> (model config, TrainConfig, full TrainState, meta) for resuming; default: the
        newest intact step."""
        config, tc, params, train, meta = self._intact(step, train=True)
        meta = {k: v for k, v in meta.items() if k != "checksums"}
        return config, tc, TrainState(params=params, **train), meta

    def restore_params(self, step: int | None = None) -> tuple[object, dict, dict]:
        """-> (model config, params, meta): the weights alone, for sampling and evaluation, in the
        layout of ``Execution.for_model(config)`` whatever Execution trained them; default: the newest
        intact step."""
        config, tc, params, _, meta = self._intact(step, train=False)
        params = to_execution(config, params, tc.execution, Execution.for_model(config))
        return config, params, {k: v for k, v in meta.items() if k != "checksums"}

    def close(self) -> None:
        if self._reader is not None:  # a read-back still running: finished first (wait() reports its outcome)
            self._reader.join()
        self._mngr.close()
