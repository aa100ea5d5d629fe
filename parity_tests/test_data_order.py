"""jaxgpt.data.order: epochs without replacement and weighted mixtures, as pure functions of (seed, sample
index). Checked against their definitions by counting (no reference implementation: exact properties)."""
import numpy as np
import pytest

from jaxgpt.data.order import MAX_PERIOD, epoch_windows, mixture_counts, mixture_samples, n_windows


def test_windows_cover_every_target_token_once():
    assert n_windows(101, 10) == 10  # windows start at 0, 10, ..., 90 and read 11 tokens: the last reads 90..100
    assert n_windows(11, 10) == 1
    with pytest.raises(ValueError, match="10 tokens hold no window: seq_len=10 needs at least 11"):
        n_windows(10, 10)


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_each_epoch_visits_every_window_exactly_once(n):
    first, second = epoch_windows(n, 0, np.arange(n)), epoch_windows(n, 0, np.arange(n, 2 * n))
    assert np.array_equal(np.sort(first), np.arange(n)) and np.array_equal(np.sort(second), np.arange(n))
    if n > 7:
        assert not np.array_equal(first, second), "each epoch has its own order"
        assert not np.array_equal(first, epoch_windows(n, 1, np.arange(n))), "the seed changes the order"


def test_any_slice_of_the_order_is_the_order_of_its_samples():
    """What a resumed run, or one process of many, computes for its samples is what one run computes."""
    whole = epoch_windows(53, 3, np.arange(500))
    idx = np.array([499, 0, 250, 53, 52, 106])
    assert np.array_equal(epoch_windows(53, 3, idx), whole[idx])
    assert np.array_equal(epoch_windows(53, 3, np.arange(120, 380).reshape(20, 13)), whole[120:380].reshape(20, 13))


def test_a_70_30_mixture_realises_its_weights_within_one_sample_everywhere():
    counts = mixture_counts([0.7, 0.3])
    assert counts == (7, 3)
    batch, steps = 8, 10_000
    source, index = mixture_samples(counts, np.arange(batch * steps))
    assert abs(np.mean(source == 0) - 0.7) <= 1 / (batch * steps)
    prefix = np.cumsum(source == 0) - 0.7 * np.arange(1, batch * steps + 1)
    assert np.abs(prefix).max() <= 1.0
    for j in (0, 1):  # each source's samples are its own stream 0, 1, 2, ...: its epochs stay without replacement
        assert np.array_equal(index[source == j], np.arange(np.sum(source == j)))


def test_mixture_indices_are_o1_and_match_the_prefix_counts():
    counts = mixture_counts([1, 2, 5])  # 1/8, 2/8, 5/8: period 8
    assert counts == (1, 2, 5)
    idx = np.array([10**9 + 3, 5, 10**12])
    source, index = mixture_samples(counts, idx)
    whole_source, whole_index = mixture_samples(counts, np.arange(16))
    for s, i, k in zip(source, index, idx):
        p = int(k % 8)
        assert s == whole_source[p] and i == (k // 8) * counts[s] + whole_index[p]


def test_weights_without_a_small_period_share_the_largest_one():
    counts = mixture_counts([np.pi, 1.0])
    assert sum(counts) == MAX_PERIOD and counts == (759, 241)  # pi / (pi + 1) = 0.7585
    with pytest.raises(ValueError, match="positive"):
        mixture_counts([0.5, -0.5])
    with pytest.raises(ValueError, match="would never be read"):
        mixture_counts([1.0, 1e-5])


@pytest.mark.parametrize("source", ["text", "token file"])
def test_epoch_order_batches_cover_every_window_once_and_depend_only_on_the_step(source, tmp_path):
    """TrainConfig(data_order='epochs'): the batches of one epoch hold every window once (text tasks through
    get_batch, token files through global_batch, the same starts), and a batch
    is a pure function of (seed, step): what a resumed run, or any process count, reads."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.batching import get_batch
    from jaxgpt.data.tokenfiles import Tokens, global_batch

    ids = np.random.default_rng(0).integers(0, 50, 1001).astype(np.uint16)  # 1001 tokens: 100 windows of 11
    tc = TrainConfig(batch_size=10, seq_len=10, data_order="epochs", seed=4)
    if source == "text":
        batch = lambda s: get_batch(ids, tc.batch_size, tc.seq_len, tc.seed, s, tc.data_order)
    else:
        (tmp_path / "t.bin").write_bytes(ids.tobytes())
        tokens = Tokens([tmp_path / "t.bin"], "uint16")
        batch = lambda s: global_batch(tokens, tc.batch_size, tc.seq_len, tc.seed, s, order=tc.data_order)
    windows = np.concatenate([np.concatenate([x, y[:, -1:]], 1) for x, y in (batch(s) for s in range(10))])
    expected = ids[:1001].astype(np.int32)[np.arange(100)[:, None] * 10 + np.arange(11)]
    got = {tuple(w) for w in windows}
    assert len(windows) == 100 and got == {tuple(w) for w in expected}
    later = [batch(s) for s in (12, 3)]  # any step, in any order: the same batch
    np.testing.assert_array_equal(later[1][0], windows[30:40, :-1])
    np.testing.assert_array_equal(later[0][0], batch(12)[0])
    assert not np.array_equal(batch(10)[0], windows[:10, :-1]), "epoch 1 is shuffled anew"


def test_an_epoch_of_steps_is_one_pass_over_the_windows():
    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.train.tasks import load_task

    tc = TrainConfig(batch_size=8, seq_len=16, data_order="epochs", val_fraction=0.0)
    task = load_task(ModelConfig(d_model=32, n_layer=1, n_head=4, max_len=16), tc, corpus="seed-synthetic")
    assert task.steps_per_epoch(tc) == -(-n_windows(len(task.train[0]), 16) // 8)
    assert task.steps_per_epoch(tc.replace(data_order="random")) == -(-(len(task.train[0]) - 16) // 8)
    with pytest.raises(ValueError, match="data_order"):
        TrainConfig(data_order="sequential")
