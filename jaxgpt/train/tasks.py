"""Training data as pure functions of the step: a Task turns (TrainConfig, step) into the batch
dict the model trains on, so a resumed run sees exactly the batches it would have seen.

Four kinds, picked by the model config and the data:

* ``lm``: decoder on text (a file or ``seed-synthetic``), random windows from ``get_batch``.
* ``pairs``: decoder on ``src<TAB>tgt`` pairs as ``<bos> src <sep> tgt <eos>`` (seed 002).
* ``seq2seq``: encoder-decoder on the same pairs (seed 004).
* ``classify``: BERT classifier on ``label<TAB>text`` rows ([CLS] = ``<bos>``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig, TrainConfig
from jaxgpt.data import (IGNORE_INDEX, CharTokenizer, PairTokenizer, builtin_corpus, builtin_pairs, encode_pairs,
                         get_batch, load_text, pad_batch, shuffled_batch, split_train_val, tokenizer_from_dict,
                         train_bpe)
from jaxgpt.data.documents import annotate
from jaxgpt.data.order import n_windows
from jaxgpt.data.tokenfiles import is_token_dir
from jaxgpt.core.validate import check_ids, check_padding_mask, check_targets

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


def with_epochs(tc: TrainConfig, task: Task) -> TrainConfig:
    """``tc`` with ``steps = epochs * steps_per_epoch`` for ``task`` when ``tc.epochs`` is set
    (unchanged otherwise): the run is that many passes over the training data."""
    if not tc.epochs:
        return tc
    per = task.steps_per_epoch(tc)
    return tc.replace(steps=tc.epochs * per, steps_per_epoch=per)


def _split_rows(arrays: tuple, val_fraction: float) -> tuple[tuple, tuple]:
    n = len(arrays[0])
    if val_fraction == 0.0:  # train on every row
        return arrays, tuple(a[:0] for a in arrays)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"{n} rows are too few to keep {n_val} for validation")
    return tuple(a[:-n_val] for a in arrays), tuple(a[-n_val:] for a in arrays)


def text_task(text: str, tc: TrainConfig, tokenizer=None, source: str = "text") -> Task:
    """Next-token windows of ``text``; the tokenizer is built from it unless given."""
    if tokenizer is None:
        tokenizer = train_bpe(text, tc.bpe_vocab) if tc.tokenizer == "bpe" else CharTokenizer.from_text(text)
    train, val = split_train_val(tokenizer.encode(text), tc.val_fraction)
    for name, part in (("training", train), ("validation", val)):
        if len(part) < tc.seq_len + 1 and (name == "training" or tc.val_fraction > 0):
            raise ValueError(f"the {name} split of {source} has {len(part)} tokens; seq_len={tc.seq_len} "
                             f"needs {tc.seq_len + 1} (use more text, a smaller seq_len or another val_fraction)")
    return Task("lm", tokenizer, (train,), (val,), source)


def pairs_task(pairs: list[tuple[str, str]], tc: TrainConfig, *, seq2seq: bool, tokenizer=None,
               source: str = "pairs") -> Task:
    """``(src, tgt)`` pairs for a decoder (``<bos> src <sep> tgt <eos>``, loss on every next
    token, padding ignored) or an encoder-decoder (src -> ``<bos> tgt``, labels ``tgt <eos>``)."""
    if not seq2seq:
        tokenizer = tokenizer or PairTokenizer.from_pairs(pairs)
        need = max(len(s) + len(t) + 3 for s, t in pairs) - 1  # <bos> s <sep> t <eos>, minus the shift
    else:
        tokenizer = tokenizer or PairTokenizer.from_texts([t for p in pairs for t in p])
        need = max(max(len(s), len(t) + 1) for s, t in pairs)  # <bos> t / t <eos>
    if need > tc.seq_len:
        raise ValueError(f"{source}: the longest pair needs seq_len >= {need}, got seq_len={tc.seq_len} "
                         f"(--set seq_len={need})")
    if not seq2seq:
        rows = encode_pairs(tokenizer, pairs, tc.seq_len + 1, target_pad=IGNORE_INDEX)
    else:
        tok = tokenizer
        src, src_mask = pad_batch([tok.encode(s) for s, _ in pairs], tc.seq_len, tok.pad_id)
        tgt_ids = [tok.encode(t).tolist() for _, t in pairs]
        tgt, _ = pad_batch([[tok.bos_id, *t] for t in tgt_ids], tc.seq_len, tok.pad_id)
        labels, _ = pad_batch([[*t, tok.eos_id] for t in tgt_ids], tc.seq_len, IGNORE_INDEX)
        rows = (src, tgt, src_mask, labels)
    train, val = _split_rows(rows, tc.val_fraction)
    if len(train[0]) < tc.batch_size:
        raise ValueError(f"{source}: {len(train[0])} training rows, fewer than batch_size={tc.batch_size}")
    return Task("seq2seq" if seq2seq else "pairs", tokenizer, train, val, source)


def classify_task(rows: list[tuple[str, str]], tc: TrainConfig, tokenizer=None, source: str = "rows") -> Task:
    """``(label, text)`` rows with integer labels; inputs ``<bos> text`` cut to seq_len."""
    labels = []
    for i, (label, _) in enumerate(rows):
        if not label.strip().isdigit():
            raise ValueError(f"{source} row {i + 1}: label {label!r} is not a non-negative integer")
        labels.append(int(label))
    tokenizer = tokenizer or PairTokenizer.from_texts([t for _, t in rows])
    ids, mask = pad_batch([[tokenizer.bos_id, *tokenizer.encode(t)] for _, t in rows], tc.seq_len,
                          tokenizer.pad_id, truncate=True)
    train, val = _split_rows((ids, mask, np.asarray(labels, np.int32)), tc.val_fraction)
    if len(train[0]) < tc.batch_size:
        raise ValueError(f"{source}: {len(train[0])} training rows, fewer than batch_size={tc.batch_size}")
    return Task("classify", tokenizer, train, val, source)


def read_tsv(path: str | Path) -> list[tuple[str, str]]:
    """Lines ``a<TAB>b`` (blank lines and ``#`` comments skipped)."""
    rows = []
    for lineno, line in enumerate(load_text(path).splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(f"{path}:{lineno}: expected 2 tab-separated fields, got {len(fields)}")
        rows.append((fields[0], fields[1]))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def load_task(config, tc: TrainConfig, *, data: str | None = None, corpus: str | None = None,
              tokenizer: dict | None = None) -> Task:
    """The task for ``config`` on a file (``.tsv``: pairs or labelled rows; anything else: text),
    a token directory (train.bin/val.bin with meta.json or nanoGPT's meta.pkl), a weighted mixture of
    token directories ('dirA=0.7,dirB=0.3': ``mixture_task``) or a built-in corpus. ``tokenizer``: a saved tokenizer dict (resuming), else built from the data."""
    if (data is None) == (corpus is None):
        raise ValueError("give exactly one of data (a file) or corpus (a built-in name)")
    from jaxgpt.train.mixture_task import mixture_task, parse_mixture

    if data is not None and parse_mixture(str(data)) is not None:  # 'dirA=0.7,dirB=0.3': a mixture
        if not isinstance(config, ModelConfig):
            raise ValueError(f"a mixture of token directories trains decoder LMs, not a {type(config).__name__}")
        return mixture_task(str(data), tc, vocab_size=config.vocab_size, tokenizer=tokenizer)
    if data is not None and is_token_dir(data):  # train.bin/val.bin + meta: memory-mapped token files
        from jaxgpt.train.token_task import token_task

        if not isinstance(config, ModelConfig):
            raise ValueError(f"{data} holds token files, which train decoder LMs, not a {type(config).__name__}")
        return token_task(data, tc, vocab_size=config.vocab_size, tokenizer=tokenizer)
    tok = None if tokenizer is None else tokenizer_from_dict(tokenizer)
    source = f"corpus:{corpus}" if corpus else str(data)
    rows = None
    if corpus == "zh-en":
        rows = builtin_pairs(corpus)
    elif data is not None and str(data).endswith(".tsv"):
        rows = read_tsv(data)
    if isinstance(config, BertConfig):
        if rows is None or corpus:
            raise ValueError("a classifier trains on --data FILE.tsv with label<TAB>text lines")
        return classify_task(rows, tc, tok, source)
    if rows is not None:
        return pairs_task(rows, tc, seq2seq=isinstance(config, EncDecConfig), tokenizer=tok, source=source)
    if isinstance(config, EncDecConfig):
        raise ValueError("an encoder-decoder trains on pairs: --corpus zh-en or --data FILE.tsv (src<TAB>tgt)")
    text = builtin_corpus(corpus) if corpus else load_text(data)
    return text_task(text, tc, tok, source)


def fit_config(config, task: Task, vocab_size: int | None = None):
    """``config`` with its vocabulary (and classes) sized to the task's tokenizer and labels.

    Decoders may keep a padded table: ``vocab_size`` (a table size asked for, e.g. ``--set vocab_size=50304``)
    or a config already padded for this tokenizer (``valid_vocab`` equal to its size: a resumed or
    fine-tuned run) gives ``vocab_size`` rows of which the tokenizer's first ``valid_vocab`` are tokens."""
    v = task.tokenizer.vocab_size
    if isinstance(config, ModelConfig):
        size = vocab_size or (config.vocab_size if config.valid_vocab == v else v)
        if size < v:
            raise ValueError(f"vocab_size={size} is smaller than the data's vocabulary ({v} tokens); a padded "
                             f"vocabulary must be at least {v}")
        return config.replace(vocab_size=size, valid_vocab=v if size > v else None)
    if isinstance(config, EncDecConfig):
        return config.replace(encoder=config.encoder.replace(vocab_size=v), decoder=config.decoder.replace(vocab_size=v))
    n_classes = int(np.concatenate([task.train[2], task.val[2]]).max()) + 1
    return config.replace(encoder=config.encoder.replace(vocab_size=v), n_classes=max(n_classes, config.n_classes))
