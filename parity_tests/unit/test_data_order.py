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
    from jaxgpt.data.tasks import load_task

    tc = TrainConfig(batch_size=8, seq_len=16, data_order="epochs", val_fraction=0.0)
    task = load_task(ModelConfig(d_model=32, n_layer=1, n_head=4, max_len=16), tc, corpus="seed-synthetic")
    assert task.steps_per_epoch(tc) == -(-n_windows(len(task.train[0]), 16) // 8)
    assert task.steps_per_epoch(tc.replace(data_order="random")) == -(-(len(task.train[0]) - 16) // 8)
    with pytest.raises(ValueError, match="data_order"):
        TrainConfig(data_order="sequential")


def _char_dir(path, ids, chars):
    """A nanoGPT-layout token directory (train.bin, val.bin, meta.pkl) over ``chars``."""
    import pickle

    path.mkdir()
    np.asarray(ids, np.uint16).tofile(path / "train.bin")
    np.asarray(ids[:200], np.uint16).tofile(path / "val.bin")
    with open(path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return path


@pytest.fixture
def two_sources(tmp_path):
    chars = [chr(ord("a") + i) for i in range(20)]
    rng = np.random.default_rng(0)  # source A holds ids 0-9 only, B ids 10-19: every row names its source
    a = _char_dir(tmp_path / "web", rng.integers(0, 10, 4001), chars)
    b = _char_dir(tmp_path / "code", rng.integers(10, 20, 2001), chars)
    return a, b, chars


@pytest.mark.parametrize("order", ["random", "epochs"])
def test_a_70_30_mixture_of_token_directories_realises_its_weights(two_sources, order):
    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.data.mixture_task import MixtureTask
    from jaxgpt.data.tasks import load_task

    a, b, _ = two_sources
    tc = TrainConfig(batch_size=4, seq_len=8, data_order=order, eval_batches=2)
    task = load_task(ModelConfig(d_model=32, n_layer=1, n_head=4, max_len=8), tc, data=f"{a}=0.7,{b}=0.3")
    assert isinstance(task, MixtureTask) and task.proportions == {"web": 0.7, "code": 0.3}
    assert task.source == f"mixture:{a}=70.0%,{b}=30.0%"
    from_a = [np.mean(task.batch(tc, s)["x"][..., 0] < 10) for s in range(10_000)]
    assert abs(np.mean(from_a) - 0.7) <= 0.01
    x = task.batch(tc, 5)["x"].reshape(4, 8)
    assert all((row < 10).all() or (row >= 10).all() for row in x), "each row is one source's window"
    assert len(task.eval_batches(tc)) == 2
    if order == "epochs":  # source B (2000 targets: 250 windows of 9) is read without replacement
        code = [r for s in range(250) for r in task.batch(tc, s)["x"].reshape(4, 8) if r[0] >= 10]
        assert len({tuple(r) for r in code[:250]}) == 250


def test_a_mixture_needs_one_tokenizer_and_whole_entries(two_sources, tmp_path):
    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.data.tasks import load_task

    a, _, chars = two_sources
    other = _char_dir(tmp_path / "other", np.zeros(500, int), chars[:19] + ["!"])
    cfg, tc = ModelConfig(d_model=32, n_layer=1, n_head=4, max_len=8), TrainConfig(batch_size=4, seq_len=8)
    with pytest.raises(ValueError, match="has another tokenizer than"):
        load_task(cfg, tc, data=f"{a}=0.5,{other}=0.5")
    with pytest.raises(ValueError, match="no number after its last '='"):
        load_task(cfg, tc, data=f"{a}=0.5,{other}=half")
    with pytest.raises(ValueError, match="no epoch length"):
        load_task(cfg, tc, data=f"{a}=0.5,{a}=0.5").steps_per_epoch(tc)
