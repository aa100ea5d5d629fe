"""Language-model training on token files (``jaxgpt.data.tokenfiles``): a ``Task`` whose data stays
memory-mapped, and whose batches are read row by row, each process reading only its rows.

The global batch of update ``step`` is a pure function of (seed, step): ``window_starts`` draws
all batch_size window starts on every process (a few integers), and each process reads the rows
its own devices hold (``shard_batch`` then hands exactly those rows to ``jax``). So the global
batch is the same for any process count, and a resumed run reads what it would have read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.data.order import n_windows
from jaxgpt.data.tokenfiles import TokenDir, global_batch, open_tokens
from jaxgpt.data.tokenizers import IdTokenizer, tokenizer_from_dict
from jaxgpt.data.task import Task


def _local_rows(tc: TrainConfig) -> np.ndarray | None:
    """Rows of the (grad_accum * micro_batch) global batch this process's devices hold, or None
    (all of them: one process, or no mesh)."""
    import jax

    if not tc.mesh or jax.process_count() == 1:
        return None
    from jaxgpt.parallel.sharding import batch_sharding, make_mesh

    shape = (tc.grad_accum, tc.micro_batch, tc.seq_len)
    idx = batch_sharding(make_mesh(tc.mesh), lead=1).addressable_devices_indices_map(shape).values()
    lo = min(i[1].start or 0 for i in idx)  # as shard_batch: the process's rows are one range of axis 1
    hi = max(tc.micro_batch if i[1].stop is None else i[1].stop for i in idx)
    return (np.arange(tc.grad_accum)[:, None] * tc.micro_batch + np.arange(lo, hi)).reshape(-1)


@dataclass(frozen=True)
class TokenTask(Task):
    """``kind='lm'`` on a token directory: ``train = (Tokens,)``, ``val = (Tokens,)`` (empty when
    the directory has no val.bin). Ids were checked when the directory was opened (a sample, or
    everything with check='full') and every batch is checked again on the host by ``fit``."""

    data: TokenDir | None = None

    def __post_init__(self):  # reading every id here would read the whole file
        pass

    def batch(self, tc: TrainConfig, step: int) -> dict:
        rows = self._rows(tc)
        x, y = global_batch(self.train[0], tc.batch_size, tc.seq_len, tc.seed, step, rows, tc.data_order)
        return self.documents(tc, {k: a.reshape(tc.grad_accum, tc.micro_batch, tc.seq_len) for k, a in (("x", x), ("y", y))})

    @property
    def eos_id(self) -> int | None:
        return None if self.data is None else self.data.eos_id

    def _rows(self, tc: TrainConfig):
        cache = self.__dict__.setdefault("_rows_cache", {})  # frozen dataclass: a plain per-object memo
        if tc.mesh not in cache:
            cache[tc.mesh] = _local_rows(tc)
        return cache[tc.mesh]

    def eval_batches(self, tc: TrainConfig) -> list[dict]:
        """``eval_batches`` random windows of val.bin (micro_batch rows each), fixed by the seed."""
        val = self.val[0]
        if len(val) == 0:
            return []
        return [self.documents(tc, dict(zip(("x", "y"), global_batch(val, tc.micro_batch, tc.seq_len, tc.seed, i))))
                for i in range(tc.eval_batches)]

    def steps_per_epoch(self, tc: TrainConfig) -> int:
        """'epochs' order: every window of seq_len + 1 tokens once (jaxgpt.data.order); 'random': as many
        windows as there are start positions (the text task's rule, seed 000's CharDataset)."""
        if tc.data_order == "epochs":
            return -(-n_windows(len(self.train[0]), tc.seq_len) // tc.batch_size)
        return -(-(len(self.train[0]) - tc.seq_len) // tc.batch_size)


def token_task(path: str, tc: TrainConfig, *, vocab_size: int | None = None, tokenizer: dict | None = None,
               need_val: bool | None = None, check: str = "sample") -> TokenTask:
    """The task of a token directory. ``vocab_size``: the model's, for directories that record none.
    ``tokenizer``: the checkpoint's (resuming); it must be the directory's. ``need_val`` (default:
    ``tc.val_fraction > 0``, i.e. evaluation asked for): a missing or empty val.bin is an error."""
    need_val = tc.val_fraction > 0 if need_val is None else need_val
    d = open_tokens(path, vocab_size=vocab_size, need_val=need_val, check=check)
    if d.tokenizer is not None:
        tok = tokenizer_from_dict(d.tokenizer)
        if tok.vocab_size != d.vocab_size:
            raise ValueError(f"{path}: the tokenizer has {tok.vocab_size} tokens but the metadata says "
                             f"vocab_size={d.vocab_size}")
    else:
        tok = IdTokenizer(d.vocab_size)
    if tokenizer is not None and tokenizer != tok.to_dict():
        raise ValueError(f"{path}: its tokenizer is not the one the checkpoint was trained with")
    if len(d.train) < tc.seq_len + 1:
        raise ValueError(f"{d.train.paths[0]} has {len(d.train)} tokens; seq_len={tc.seq_len} needs {tc.seq_len + 1}")
    val = d.val if d.val is not None and need_val else np.zeros(0, np.uint16)  # val_fraction=0: no evaluation
    if need_val and len(val) < tc.seq_len + 1:
        raise ValueError(f"{d.val.paths[0]} has {len(val)} tokens; seq_len={tc.seq_len} needs {tc.seq_len + 1} "
                         "for evaluation: rerun jaxgpt prepare with a larger --min-val-tokens, use a smaller seq_len, "
                         "or --set val_fraction=0 (no evaluation)")
    return TokenTask("lm", tok, (d.train,), (val,), str(path), data=d)


__all__ = ["TokenTask", "token_task"]
