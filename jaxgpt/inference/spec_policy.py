"""When speculative decoding pays: a rule from the engine's own measurements (``spec_max_batch='auto'``).

A speculative round of k proposals costs one call of the draft (k + 1 decode steps) and one target
call of k + 1 tokens a row; it emits the accepted proposals plus one token. Whether that beats one
plain decode step a token depends on the acceptance rate and on how the calls' cost grows with the
batch (weight-bound at one row, compute-bound at eight on a CPU), so the crossover batch size moves
with the draft/target pair (docs/serving.md, "Speculation turns itself off under load").
``SpecPolicy`` measures both online and decides each step, for the step's batch size bucket:

    expected tokens a row per round  E = (1 - alpha^(k+1)) / (1 - alpha)
    speculate  iff  E / t_spec(bucket) > 1 / t_plain(bucket)

alpha is the per-token acceptance rate: a proposal is accepted with probability alpha given that
every earlier one was (the geometric model behind E), estimated as accepted / (accepted +
rejections). Proposals after a row's first rejection were never tested and count in neither (the
engine's ``spec_accepted / spec_proposed`` counts them, and is lower). Counts decay by
``ALPHA_KEEP`` a round, so alpha follows the last ~10 rounds; ``ALPHA_PRIOR`` (worth ``PRIOR_TESTED``
tested proposals) stands in before any. t_spec and t_plain are medians of a bucket's last
``TIME_SAMPLES`` call times (a GC pause or another process's burst is one sample, not the estimate).

A bucket missing a time takes the mode it lacks (speculation first), and every ``EXPLORE_EVERY``-th
step of a bucket takes the losing mode once, so a change of acceptance or load can flip the rule
back. Pure Python and deterministic given the timings the engine feeds it (``Engine._run`` times
its speculative and plain decode calls, host sync included, after waiting for the draft's queued
work; calls that compiled are left out).
"""
from __future__ import annotations

import statistics
from collections import deque

EXPLORE_EVERY = 32  # a bucket's every 32nd step takes the losing mode: at most ~3% of its steps
ALPHA_PRIOR = 0.5
PRIOR_TESTED = 2.0  # the prior weighs as much as two tested proposals: the first round outweighs it
ALPHA_KEEP = 0.9  # each round keeps 90% of the counts before it: alpha follows the last ~10 rounds
TIME_SAMPLES = 5


class SpecPolicy:
    """Decides per step whether rows speculate (``speculates``), fed call times (``record_time``)
    and each round's acceptance (``record_round``). Buckets are the caller's row-count buckets."""

    def __init__(self, k: int, *, explore_every: int = EXPLORE_EVERY):
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 (every step would explore), got {explore_every}")
        self.k, self.explore_every = k, explore_every
        self._accepted, self._tested = ALPHA_PRIOR * PRIOR_TESTED, PRIOR_TESTED
        self._times: dict[tuple[bool, int], deque[float]] = {}  # (speculative?, bucket) -> recent seconds
        self._since: dict[int, int] = {}  # bucket -> its steps since the losing mode was last explored

    @property
    def alpha(self) -> float:
        return self._accepted / self._tested

    def expected_tokens(self) -> float:
        """Tokens a row emits per round at the current alpha (k + 1 when every proposal is accepted)."""
        a = self.alpha
        return self.k + 1.0 if a >= 1.0 else (1.0 - a ** (self.k + 1)) / (1.0 - a)

    def time(self, speculative: bool, bucket: int) -> float | None:
        """The estimated seconds of a call of this mode at this bucket; None before any sample."""
        samples = self._times.get((speculative, bucket))
        return statistics.median(samples) if samples else None

    def wins(self, bucket: int) -> bool | None:
        """Whether speculation yields more tokens a second at this bucket; None while a time is missing."""
        t_spec, t_plain = self.time(True, bucket), self.time(False, bucket)
        if t_spec is None or t_plain is None:
            return None
        return self.expected_tokens() * t_plain > t_spec  # E / t_spec > 1 / t_plain, no division by a 0 s fake time

    def speculates(self, bucket: int) -> bool:
        """This step's decision for a batch in ``bucket`` (advances the bucket's exploration count:
        call it once a step)."""
        if self.time(True, bucket) is None:
            return True
        wins = self.wins(bucket)
        if wins is None:
            return False  # t_plain is the missing one
        n = self._since.get(bucket, 0) + 1
        self._since[bucket] = 0 if n >= self.explore_every else n
        return wins != (n >= self.explore_every)  # the losing mode once every explore_every steps

    def record_time(self, speculative: bool, bucket: int, seconds: float) -> None:
        self._times.setdefault((speculative, bucket), deque(maxlen=TIME_SAMPLES)).append(float(seconds))

    def record_round(self, accepted: int, rejections: int) -> None:
        """One round's totals over its rows: proposals accepted, and rows that stopped at a rejection."""
        self._accepted = self._accepted * ALPHA_KEEP + accepted
        self._tested = self._tested * ALPHA_KEEP + accepted + rejections

    def estimates(self) -> dict:
        """alpha, expected tokens a round, and per bucket: the two times and the decision (for /metrics,
        on another thread than the engine's: list() copies the keys in one step, before a new bucket
        could change the dict's size mid-iteration)."""
        buckets = sorted({b for _, b in list(self._times)})
        return dict(alpha=self.alpha, expected_tokens=self.expected_tokens(),
                    buckets={b: dict(t_spec=self.time(True, b), t_plain=self.time(False, b), wins=self.wins(b))
                             for b in buckets})
