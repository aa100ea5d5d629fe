"""What a run trains on: ``load_task`` picks the ``Task`` (``jaxgpt.data.task``) for a model config
and its data (a text file, pairs or labelled rows, a token directory, a mixture of token directories
or a built-in corpus); ``fit_config`` sizes the config to the task's tokenizer, ``with_epochs`` the
run to its data. Batches are pure functions of the step, so a resumed run sees exactly the batches
it would have seen.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxgpt.config import BertConfig, EncDecConfig, ModelConfig, TrainConfig
from jaxgpt.data import (IGNORE_INDEX, CharTokenizer, PairTokenizer, builtin_corpus, builtin_pairs, encode_pairs,
                         load_text, pad_batch, split_train_val, tokenizer_from_dict, train_bpe)
from jaxgpt.data.mixture_task import mixture_task, parse_mixture
from jaxgpt.data.task import Task
from jaxgpt.data.token_task import token_task
from jaxgpt.data.tokenfiles import is_token_dir


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
    if data is not None and parse_mixture(str(data)) is not None:  # 'dirA=0.7,dirB=0.3': a mixture
        if not isinstance(config, ModelConfig):
            raise ValueError(f"a mixture of token directories trains decoder LMs, not a {type(config).__name__}")
        return mixture_task(str(data), tc, vocab_size=config.vocab_size, tokenizer=tokenizer)
    if data is not None and is_token_dir(data):  # train.bin/val.bin + meta: memory-mapped token files
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


__all__ = ["Task", "classify_task", "fit_config", "load_task", "pairs_task", "read_tsv", "text_task", "with_epochs"]
