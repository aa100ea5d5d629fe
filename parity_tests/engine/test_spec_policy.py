"""The auto rule of speculative decoding (``spec_policy.SpecPolicy``, ``spec_max_batch='auto'``),
with injected call times and acceptance counts, no model: it speculates at a bucket iff
E / t_spec > 1 / t_plain, E the expected tokens a round. E is checked against the geometric model
summed term by term here (not the closed form the policy uses); alpha against the acceptance rate
the counts were generated from. The engine running this rule (greedy tokens identical to
transformers' as it flips) is test_engine_speculative.py's; ``--spec-max-batch`` parsing is here.
"""
from __future__ import annotations

import pytest

from jaxgpt.inference.spec_policy import ALPHA_PRIOR, EXPLORE_EVERY, TIME_SAMPLES, SpecPolicy


def _expected_tokens(a, k):
    """Tokens a row emits per round, P(m accepted) * (m + 1) summed: m < k stops at a rejection."""
    return sum(a ** m * (1 - a) * (m + 1) for m in range(k)) + a ** k * (k + 1)


def _trained(a, k, rounds=200, rows=8):
    """A policy fed rounds whose counts are the geometric model's expectations at acceptance a."""
    pol = SpecPolicy(k)
    accepted = rows * sum(a ** i for i in range(1, k + 1))  # E[m] a row
    for _ in range(rounds):
        pol.record_round(accepted, rows * (1 - a ** k))  # rows stopped at a rejection
    return pol


def _timed(pol, bucket, t_spec, t_plain):
    for _ in range(TIME_SAMPLES):
        pol.record_time(True, bucket, t_spec)
        pol.record_time(False, bucket, t_plain)
    return pol


def _decisions(pol, bucket, n):
    return [pol.speculates(bucket) for _ in range(n)]


def test_prior_and_exploration_of_an_unmeasured_bucket():
    pol = SpecPolicy(3)
    assert pol.alpha == ALPHA_PRIOR == 0.5
    assert pol.expected_tokens() == pytest.approx(_expected_tokens(0.5, 3), abs=1e-12)  # 1.875
    assert pol.estimates() == dict(alpha=0.5, expected_tokens=pytest.approx(1.875), buckets={})
    assert _decisions(pol, 4, 3) == [True] * 3  # no t_spec yet: speculate to measure it
    pol.record_time(True, 4, 1.0)
    assert _decisions(pol, 4, 3) == [False] * 3  # then plain decode, for t_plain
    pol.record_time(False, 4, 1.0)
    assert pol.speculates(4)  # E = 1.875 tokens for 1.0 s against 1 token for 1.0 s
    assert pol.speculates(2) and pol.time(False, 2) is None  # buckets are measured apart


@pytest.mark.parametrize("a", [0.3, 0.8, 0.97])
def test_alpha_is_the_per_token_acceptance_rate(a):
    """accepted / (accepted + rejections) converges to a; accepted / proposed (every row's k
    proposals, the /metrics rate) would not."""
    k = 4
    pol = _trained(a, k)
    assert pol.alpha == pytest.approx(a, abs=1e-4)
    assert pol.expected_tokens() == pytest.approx(_expected_tokens(a, k), rel=1e-3)
    assert sum(a ** i for i in range(1, k + 1)) / k < a - 0.02  # the per-proposal rate is lower


def test_all_accepted_rounds_give_k_plus_one_tokens():
    pol = SpecPolicy(4)
    for _ in range(300):
        pol.record_round(8 * 4, 0)
    assert pol.alpha == pytest.approx(1.0, abs=1e-9)
    assert pol.expected_tokens() == pytest.approx(5.0, abs=1e-6)


def test_the_comparison_at_its_boundary():
    """E = 1.875 (alpha 0.5, k = 3): a round of t_spec wins against plain steps of 1 s iff t_spec < 1.875 s."""
    assert _timed(SpecPolicy(3), 8, 1.87, 1.0).speculates(8)
    assert not _timed(SpecPolicy(3), 8, 1.88, 1.0).speculates(8)
    assert _timed(SpecPolicy(3), 8, 3.74, 2.0).speculates(8)  # the ratio decides, not the times alone
    assert not _timed(SpecPolicy(3), 8, 1.0, 0.5).speculates(8)


def test_high_acceptance_and_cheap_rounds_speculate_at_a_large_bucket():
    pol = _timed(_trained(0.97, 4), 8, 2.0, 1.0)  # E = 4.7 tokens for twice a plain step's time
    assert pol.wins(8)
    got = _decisions(pol, 8, 2 * EXPLORE_EVERY)
    assert got == ([True] * (EXPLORE_EVERY - 1) + [False]) * 2  # plain decode re-measured every 32nd step


def test_low_acceptance_or_costly_rounds_turn_it_off_and_a_small_batch_on_again():
    pol = _timed(_trained(0.3, 4), 8, 2.0, 1.0)  # E = 1.43 tokens for twice a plain step's time
    got = _decisions(pol, 8, EXPLORE_EVERY)
    assert got == [False] * (EXPLORE_EVERY - 1) + [True]  # a round re-measured every 32nd step
    pol = _timed(_trained(0.8, 4), 8, 4.0, 1.0)  # E = 3.36 tokens; rounds cost 4 plain steps at 8 rows
    _timed(pol, 1, 1.2, 1.0)  # at one row a round costs little more than a plain step
    assert _decisions(pol, 8, 3) == [False] * 3
    assert _decisions(pol, 1, 3) == [True] * 3  # the batch shrank: back on
    assert _decisions(pol, 8, 3) == [False] * 3  # and grew again
    assert pol.estimates()["buckets"] == {1: dict(t_spec=1.2, t_plain=1.0, wins=True),
                                          8: dict(t_spec=4.0, t_plain=1.0, wins=False)}


def test_the_rule_follows_acceptance_and_time_changes():
    pol = _timed(_trained(0.9, 4), 8, 2.0, 1.0)  # E = 4.1
    assert pol.speculates(8)
    for _ in range(5):  # the draft stops agreeing: every row rejects its first proposal
        pol.record_round(0, 8)
    assert pol.wins(8)  # a few rounds move alpha, not yet below the break-even (E = 2 near alpha 0.51)
    for _ in range(15):
        pol.record_round(0, 8)
    assert pol.alpha < 0.35 and not pol.speculates(8)
    pol = _timed(_trained(0.9, 4), 8, 2.0, 1.0)
    pol.record_time(True, 8, 50.0)  # one slow round (a GC pause, another process): the median holds
    assert pol.speculates(8)
    for _ in range(TIME_SAMPLES // 2):  # a majority of the recent rounds slow: off
        pol.record_time(True, 8, 50.0)
    assert not pol.speculates(8)


def test_explore_every_is_a_setting():
    pol = _timed(SpecPolicy(3, explore_every=4), 2, 1.0, 1.0)
    assert _decisions(pol, 2, 8) == [True, True, True, False] * 2
    with pytest.raises(ValueError, match="explore_every must be >= 2 .* got 1"):
        SpecPolicy(3, explore_every=1)


@pytest.mark.parametrize("text, want", [("auto", "auto"), ("3", 3)])
def test_cli_spec_max_batch_takes_auto_or_an_int(text, want):
    from jaxgpt.cli import build_parser

    assert build_parser().parse_args(["serve", "m", "--spec-max-batch", text]).spec_max_batch == want
    assert build_parser().parse_args(["serve", "m"]).spec_max_batch is None  # the Engine's default, 'auto'


@pytest.mark.parametrize("text", ["0", "-2", "1.5", "always"])
def test_cli_spec_max_batch_refuses_other_values(text, capsys):
    from jaxgpt.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--spec-max-batch", text])
    assert f"expected 'auto' or an int >= 1 (requests running), got {text!r}" in capsys.readouterr().err
