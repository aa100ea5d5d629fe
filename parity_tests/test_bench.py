"""jaxgpt.bench on a tiny decoder: every number is there, positive and finite, the table shows
each row, and the configs it cannot measure are refused with a clear message."""
from __future__ import annotations

import json
import math

import pytest

from jaxgpt.bench import _preset_name, bench, format_table
from jaxgpt.config import get_preset

TINY = get_preset("seed-minigpt").replace(n_layer=2)
RATES = ("train_tok_s", "train_ms_step", "compile_s", "decode_cached_tok_s", "decode_uncached_tok_s")


@pytest.fixture(scope="module")
def result():
    return bench(TINY, batch_size=2, seq_len=32, steps=2, new_tokens=8, torch=True)


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


def test_table_without_torch(result):
    table = format_table({k: v for k, v in result.items() if not k.startswith("torch_")})
    assert "decode (no cache)" in table and "torch" not in table


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
