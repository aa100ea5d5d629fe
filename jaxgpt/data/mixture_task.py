"""Language-model training on several token directories at fixed weights: ``--data 'web=0.7,code=0.3'``
(``jaxgpt train``, or ``load_task(data=...)``). Each global sample is assigned to a source by
``jaxgpt.data.order``'s mixture schedule (every prefix within one sample of the weights, the same for
any process count and at any resumed step), and reads a window of that source:

* ``data_order='epochs'``: the source's own epochs, each of its windows once per pass over it;
* ``data_order='random'``: starts drawn from ``default_rng([seed, source, step])`` with replacement.

All sources share one tokenizer (the directories' meta), and evaluation reads every source's val.bin
in the same proportions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxgpt.config import TrainConfig
from jaxgpt.data.order import epoch_windows, mixture_counts, mixture_samples, n_windows
from jaxgpt.data.token_task import TokenTask, token_task


def parse_mixture(spec: str) -> list[tuple[str, float]] | None:
    """'dirA=0.7,dirB=0.3' -> [('dirA', 0.7), ('dirB', 0.3)]; None for one path (an existing one is
    always a path, whatever characters its name holds)."""
    if Path(spec).exists() or "=" not in spec:
        return None
    parts = []
    for item in spec.split(","):
        path, _, weight = item.strip().rpartition("=")
        try:
            parts.append((path, float(weight)))
        except ValueError:
            raise ValueError(f"--data {spec!r}: a mixture is DIR=WEIGHT,DIR=WEIGHT,...; {item!r} has no number "
                             "after its last '='") from None
    return parts


@dataclass(frozen=True)
class MixtureTask(TokenTask):
    """``train``/``val``: one Tokens per source; ``counts``: the sources' slots in the schedule's period."""

    counts: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def proportions(self) -> dict[str, float]:
        """The realised share of each source: exact over every period of the schedule."""
        return {n: c / sum(self.counts) for n, c in zip(self.names, self.counts)}

    def _windows(self, splits, samples: np.ndarray, tc: TrainConfig, step: int, rows, epochs: bool) -> np.ndarray:
        """(len(samples), seq_len + 1) windows; with ``rows`` only those rows are read (another process holds
        the others)."""
        t = tc.seq_len
        source, index = mixture_samples(self.counts, samples)
        w = np.zeros((len(samples), t + 1), np.int32)
        mine = np.ones(len(samples), bool) if rows is None else np.isin(np.arange(len(samples)), rows)
        for j, tokens in enumerate(splits):
            at = np.flatnonzero(source == j)
            if epochs:
                starts = epoch_windows(n_windows(len(tokens), t), tc.seed + j, index[at]) * t
            else:
                starts = np.random.default_rng([tc.seed, j, step]).integers(0, len(tokens) - t, size=len(at))
            keep = mine[at]
            w[at[keep]] = tokens.windows(starts[keep], t + 1)
        return w

    def batch(self, tc: TrainConfig, step: int) -> dict:
        samples = step * tc.batch_size + np.arange(tc.batch_size, dtype=np.int64)
        w = self._windows(self.train, samples, tc, step, self._rows(tc), tc.data_order == "epochs")
        return self.documents(tc, {k: a.reshape(tc.grad_accum, tc.micro_batch, tc.seq_len)
                                   for k, a in (("x", w[:, :-1]), ("y", w[:, 1:]))})

    def eval_batches(self, tc: TrainConfig) -> list[dict]:
        if any(len(v) == 0 for v in self.val):
            return []
        out = []
        for i in range(tc.eval_batches):  # the same proportions, random windows fixed by the seed
            w = self._windows(self.val, i * tc.micro_batch + np.arange(tc.micro_batch), tc, i, None, False)
            out.append(self.documents(tc, {"x": w[:, :-1], "y": w[:, 1:]}))
        return out

    def steps_per_epoch(self, tc: TrainConfig) -> int:
        raise ValueError("a mixture of token directories has no epoch length (each source runs its own epochs): "
                         "give steps instead of epochs")


def mixture_task(spec: str, tc: TrainConfig, *, vocab_size: int | None = None, tokenizer: dict | None = None
                 ) -> MixtureTask:
    """The task of ``spec`` ('dirA=0.7,dirB=0.3'): every directory opened as ``token_task`` does, one
    tokenizer for all (else an error naming the first that differs)."""
    parts = parse_mixture(spec)
    if not parts or len(parts) < 2:
        raise ValueError(f"--data {spec!r}: a mixture needs two or more DIR=WEIGHT entries")
    tasks = [token_task(path, tc, vocab_size=vocab_size, tokenizer=tokenizer) for path, _ in parts]
    first = tasks[0].tokenizer.to_dict()
    for (path, _), t in zip(parts[1:], tasks[1:]):
        if t.tokenizer.to_dict() != first:
            raise ValueError(f"--data {spec!r}: {path} has another tokenizer than {parts[0][0]}; a mixture trains "
                             "one vocabulary (prepare every directory with the same tokenizer)")
        if t.eos_id != tasks[0].eos_id:
            raise ValueError(f"--data {spec!r}: {path} separates documents with EOS id {t.eos_id}, "
                             f"{parts[0][0]} with {tasks[0].eos_id}; prepare every directory with the same --eos")
    counts = mixture_counts([w for _, w in parts])
    names = tuple(Path(p).name or p for p, _ in parts)
    share = ",".join(f"{p}={100 * c / sum(counts):.1f}%" for (p, _), c in zip(parts, counts))
    return MixtureTask("lm", tasks[0].tokenizer, tuple(t.train[0] for t in tasks), tuple(t.val[0] for t in tasks),
                       f"mixture:{share}", data=tasks[0].data, counts=counts, names=names)


__all__ = ["MixtureTask", "mixture_task", "parse_mixture"]
