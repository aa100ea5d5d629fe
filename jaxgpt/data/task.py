"""A training task: the data a run trains on, and its batches as pure functions of the step (``Task``).

Four kinds, picked by the model config and the data (``jaxgpt.data.tasks.load_task``):

* ``lm``: decoder on text (a file or ``seed-synthetic``), random windows from ``get_batch``.
* ``pairs``: decoder on ``src<TAB>tgt`` pairs as ``<bos> src <sep> tgt <eos>`` (seed 002).
* ``seq2seq``: encoder-decoder on the same pairs (seed 004).
* ``classify``: BERT classifier on ``label<TAB>text`` rows ([CLS] = ``<bos>``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.core.validate import check_ids, check_padding_mask, check_targets
from jaxgpt.data.batching import get_batch, shuffled_batch
from jaxgpt.data.documents import annotate
from jaxgpt.data.order import n_windows

KEYS = {"lm": ("x", "y"), "pairs": ("x", "y"), "seq2seq": ("src", "tgt", "src_mask", "labels"),
        "classify": ("input_ids", "attention_mask", "labels")}


@dataclass(frozen=True)
class Task:
    kind: str
    tokenizer: Any
    train: tuple  # lm: (ids (N,),); otherwise row arrays (N, ...) in KEYS[kind] order
    val: tuple
    source: str  # what the data was, for the checkpoint's record

    def __post_init__(self):
        """Validate every id and target once, where the data enters: JAX would clamp a bad id
        or score a bad target silently inside the jitted step."""
        v = self.tokenizer.vocab_size
        target = {"pairs": "y", "seq2seq": "labels"}.get(self.kind)  # next-token / decoder targets
        for split, arrays in (("training", self.train), ("validation", self.val)):
            a = dict(zip(("ids",) if self.kind == "lm" else self.keys, arrays))
            where = lambda k: f"{self.source} {split} {k!r}"  # noqa: B023 - called in this iteration
            for k in ("ids", "x", "src", "tgt", "input_ids"):
                if k in a:
                    check_ids(a[k], v, where=where(k))
            for k, like in (("src_mask", "src"), ("attention_mask", "input_ids")):
                if k in a:
                    check_padding_mask(a[k], a[like].shape, where=where(k))
            if target:
                check_targets(a[target], v, where=where(target))
            if self.kind == "classify":  # the upper bound is the model's n_classes (fit_config)
                check_ids(a["labels"], np.iinfo(np.int32).max, where=where("labels"), what="label",
                          space="the non-negative integers")

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS[self.kind]

    @property
    def eos_id(self) -> int | None:
        """The id that separates documents in language-model data (None: none known)."""
        return getattr(self.tokenizer, "eos_id", None)

    def documents(self, tc: TrainConfig, batch: dict) -> dict:
        """A language-model batch with the document inputs ``tc.documents`` asks for (jaxgpt.data.documents)."""
        return annotate(batch, tc.documents, self.eos_id, self.source)

    def batch(self, tc: TrainConfig, step: int) -> dict:
        """Batch of update ``step``: arrays (grad_accum, micro_batch, ...)."""
        if self.kind == "lm":
            arrays = get_batch(self.train[0], tc.batch_size, tc.seq_len, tc.seed, step, tc.data_order)
        else:
            arrays = shuffled_batch(self.train, tc.batch_size, tc.seed, step)
        batch = {k: a.reshape(tc.grad_accum, tc.micro_batch, *a.shape[1:]) for k, a in zip(self.keys, arrays)}
        return self.documents(tc, batch) if self.kind == "lm" else batch

    def eval_batches(self, tc: TrainConfig) -> list[dict]:
        """Fixed validation batches (no micro-batch axis): ``eval_batches`` random windows of the
        validation text, or the validation rows in order (at most eval_batches x micro_batch)."""
        if len(self.val[0]) == 0:  # val_fraction=0: nothing held out
            return []
        if self.kind == "lm":
            return [self.documents(tc, dict(zip(self.keys, get_batch(self.val[0], tc.micro_batch, tc.seq_len, tc.seed, i))))
                    for i in range(tc.eval_batches)]
        n = min(len(self.val[0]), tc.eval_batches * tc.micro_batch)
        return [{k: a[i:i + tc.micro_batch] for k, a in zip(self.keys, self.val)} for i in range(0, n, tc.micro_batch)]

    def tokens_per_step(self, tc: TrainConfig) -> int:
        return tc.batch_size * tc.seq_len

    def steps_per_epoch(self, tc: TrainConfig) -> int:
        """Updates per pass over the training data. Rows: rows // batch_size (``shuffled_batch`` uses
        each row once per epoch and drops the remainder). Text: ceil(windows / batch_size), as a
        DataLoader over every window (seed 000's CharDataset); the windows themselves are drawn at
        random (``get_batch``), so an epoch sees as many windows, not each window once."""
        if self.kind == "lm" and tc.data_order == "epochs":  # each window of T + 1 tokens once (data.order)
            return -(-n_windows(len(self.train[0]), tc.seq_len) // tc.batch_size)
        if self.kind == "lm":
            return -(-(len(self.train[0]) - tc.seq_len) // tc.batch_size)
        return len(self.train[0]) // tc.batch_size


__all__ = ["KEYS", "Task"]
