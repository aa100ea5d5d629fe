"""jaxgpt.tools.bench on a tiny decoder: every number is there, positive and finite, the table shows
each row, and the configs it cannot measure are refused with a clear message."""
from __future__ import annotations

import json
import math

import pytest

from jaxgpt.tools.bench import _preset_name, bench, format_table
from jaxgpt.config import get_preset

TINY = get_preset("seed-minigpt").replace(n_layer=2)
RATES = ("train_tok_s", "train_ms_step", "compile_s", "decode_cached_tok_s", "decode_uncached_tok_s")


@pytest.fixture(scope="module")
def result():
    return bench(TINY, batch_size=2, seq_len=32, steps=2, new_tokens=8, torch=True)


@pytest.mark.e2e  # runs the benchmark harness: make test-slow
def test_keys_and_numbers(result):
    for key in ("config", "backend", "device", "params", "batch_size", "seq_len") + RATES:
        assert key in result, key
    assert result["batch_size"] == 2 and result["seq_len"] == 32
    assert result["params"] > 0 and result["config"] == TINY.to_dict()
    for key in RATES + tuple("torch_" + k for k in RATES if k != "compile_s"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    # tokens/s and ms/step describe the same timing
    assert result["train_tok_s"] == pytest.approx(2 * 32 * 1e3 / result["train_ms_step"], rel=1e-6)
    json.dumps(result)  # JSON-friendly


def test_preset_names():
    assert _preset_name(get_preset("seed-minigpt")) == "seed-minigpt"  # a config equal to a preset is named
    assert _preset_name(TINY) is None


@pytest.mark.e2e  # runs the benchmark harness: make test-slow
def test_table_without_torch(result):
    table = format_table({k: v for k, v in result.items() if not k.startswith("torch_")})
    assert "decode (no cache)" in table and "torch" not in table


@pytest.mark.e2e  # runs the benchmark harness: make test-slow
def test_table(result):
    table = format_table(result)
    for row in ("train step", "decode (KV cache)", "decode (no cache)"):
        assert row in table
    assert "jaxgpt" in table and "torch" in table
    body = table.splitlines()[1:]
    assert len({len(line) for line in body}) == 1  # aligned columns


def test_rejects_non_decoders():
    with pytest.raises(ValueError, match="bench measures decoder language models; seed-minibert is a BertConfig"):
        bench(get_preset("seed-minibert"))
    with pytest.raises(ValueError, match="bench measures decoder language models; seed-transformer is an EncDecConfig"):
        bench("seed-transformer")


def test_rejects_sequences_past_the_context_window():
    with pytest.raises(ValueError, match=r"8 \+ 249 = 257 exceeds max_len=256"):
        bench(TINY, prompt_len=8, new_tokens=249)
    with pytest.raises(ValueError, match="seq_len=512 exceeds"):
        bench(TINY, seq_len=512)


# ---- scripts/benchmarks/bench_train.py: the jaxgpt vs torch_ref train-step race

def _bench_train():
    from scripts.benchmarks import bench_train
    return bench_train


def test_model_flops_count_the_matmuls_not_the_position_table():
    """6 N + 12 L T d FLOPs per token, N counted by hand for the no-bias nanoGPT layout
    (tied embedding, LayerNorm weights only) and compared with the script's figure."""
    from jaxgpt.models import abstract_params, count_params
    bt = _bench_train()
    config, batch, seq_len, _ = bt.SHAPES["cpu-small"]
    d, layers, vocab = config.d_model, config.n_layer, config.vocab_size
    n_matmul = layers * (12 * d * d + 2 * d) + vocab * d + d  # blocks + tied embedding + final norm
    n_params = count_params(abstract_params(config))
    assert n_params == n_matmul + config.max_len * d  # + the learned position table
    expected = (6 * n_matmul + 12 * layers * seq_len * d) * batch * seq_len
    assert bt.model_flops_per_step(config, n_params, batch, seq_len) == expected


@pytest.mark.smoke  # the script end to end in a subprocess: make test-slow
def test_bench_train_quick_smoke(tmp_path):
    """The CI smoke run: both frameworks in their own processes, every field the table needs."""
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "bench_train.json"
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "scripts.benchmarks.bench_train", "--quick", "--out", str(out)], cwd=root,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["peak_gflops"]) == {"jax", "torch"} and result["peak"] == max(result["peak_gflops"].values())
    assert all(math.isfinite(v) and v > 0 for v in result["peak_gflops"].values())
    rows = result["shapes"]["quick"]["rows"]
    assert set(rows) == {"torch-eager", "jaxgpt-default", "jaxgpt-unrolled-dp2"}
    for name, row in rows.items():
        assert "error" not in row, row
        for key in ("ms_step", "tok_s", "gflops", "mfu", "vs_torch_eager"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key)
        assert row["tok_s"] == pytest.approx(4 * 16 * 1e3 / row["ms_step"], rel=1e-6)
        assert row["mfu"] == pytest.approx(row["gflops"] / result["peak"], rel=1e-6)
    assert rows["torch-eager"]["vs_torch_eager"] == 1.0
    # the table names the setting it measured; 2 host devices ran (the batch split over them)
    assert rows["jaxgpt-unrolled-dp2"]["setting"] == {"scan_layers": False, "host_devices": 2}
    assert rows["jaxgpt-unrolled-dp2"]["batch_shards"] == 2
    # the default: batches placed as fit places them, rows split over the auto mesh (every host CPU device)
    assert rows["jaxgpt-default"]["batch_shards"] == rows["jaxgpt-default"]["setting"]["host_devices"]
    assert result["shapes"]["quick"]["best_jaxgpt"] in ("jaxgpt-default", "jaxgpt-unrolled-dp2")
    for row in rows.values():  # random tokens over 65 symbols: a few steps stay near log(65) = 4.17
        assert abs(row["loss"] - math.log(65)) < 0.5, row["loss"]
    table = out.with_suffix(".md").read_text()
    assert "| jaxgpt-unrolled-dp2 | scan_layers=False, host_devices=2 |" in table and "Best jaxgpt: " in table



def test_bench_gpu_flops_and_batch_fit():
    """bench_gpu's MFU numerator is nanoGPT's estimate (its GPT-2 124M: 123,587,328 weights without the
    position table), and the 80 GB batch estimate is the line through two measured peaks."""
    from scripts.benchmarks import bench_gpu

    d, layers, t = 768, 12, 1024
    n = 50304 * d + layers * 12 * d * d + (2 * layers + 1) * d
    assert n == 123_587_328  # nanoGPT's GPT(bias=False).get_num_params() at vocab 50304, block 1024
    assert bench_gpu.flops_per_step("gpt2-small", 12, t) == (6 * n + 12 * layers * d * t) * 12 * t
    assert bench_gpu.fit_max_batch([(12, 10e9), (32, 20e9)]) == 152  # 4 GB fixed + 0.5 GB a row
    assert bench_gpu.fit_max_batch([(12, 10e9)]) is None


@pytest.mark.smoke  # the script end to end in subprocesses: make test-slow
def test_bench_gpu_quick_smoke(tmp_path):
    """bench_gpu --quick on whatever backend is here: nanoGPT's model.py (eager), jaxgpt's default step
    and a variant in their own processes, every row of the table (one batch: about 20 s)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import SHARED, require_shared

    nanogpt = require_shared(SHARED / "reference" / "nanogpt" / "model.py").parent
    out = tmp_path / "gpu.md"
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "scripts.benchmarks.bench_gpu", "--quick", "--batches", "2", "--no-decode",
                        "--nanogpt", str(nanogpt), "--variant", 'rolled={"config": {"scan_unroll": 1}}', "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    for arms in result["train"].values():
        assert {"nanogpt-compile", "jaxgpt"} <= set(arms), arms
        for name, r in arms.items():
            assert "error" not in r, (name, r)
            assert len(r["ms"]) == 3 and all(m > 0 for m in r["ms"]) and math.isfinite(r["loss"])
    assert "jaxgpt-rolled" in result["train"]["2"]
    table = out.read_text()
    assert "| jaxgpt-rolled |" in table and "## Batch 2" in table and "## Batch 4" not in table


def test_step_times_times_what_follows_the_warm_up_and_threads_the_state():
    """jaxgpt.core.timing.step_times, the one step timer: a fake step that sleeps its batch's
    seconds (a clock the test sets itself) and counts its calls in the state."""
    import time

    from jaxgpt.core.timing import step_times

    synced = []

    def step(state, seconds):
        time.sleep(seconds)
        return state + 1, f"out{state}"

    state, out, times = step_times(step, 0, [0.2, 0.01, 0.03], warm=1, sync=synced.append)
    assert (state, out, synced) == (3, "out2", ["out0", "out1", "out2"])  # each call synchronised
    assert len(times) == 2 and 0.01 <= times[0] < 0.1 and 0.03 <= times[1] < 0.15  # not the 0.2 s warm-up
    state, out, (mean,) = step_times(step, 0, [0.2, 0.02, 0.04], sync=synced.append, overlap=True)
    assert state == 3 and synced[-1] == (3, "out2") and 0.03 <= mean < 0.12  # one sync at the end, the mean
    with pytest.raises(ValueError, match="warm=2 leaves none of the 2 batches to time"):
        step_times(step, 0, [0.0, 0.0], warm=2)
