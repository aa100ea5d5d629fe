"""jaxgpt.data.generated (the built-in generated tasks) and the smoke runs of the experiment scripts that
use them: scripts/experiments/exp_attention_basics.py and exp_seed004.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.data import generated as g

ROOT = Path(__file__).resolve().parents[2]


def test_sentiment_rows_deterministic_balanced_and_labelled_by_the_rule():
    rows = g.sentiment_rows(400, seed=3)
    assert rows == g.sentiment_rows(400, seed=3)
    assert rows != g.sentiment_rows(400, seed=4)
    assert len({t for _, t in rows}) == 400  # no repeated text
    assert sum(lab == "1" for lab, _ in rows) == 200
    for lab, text in rows:
        words = text.split()
        assert 3 <= len(words) <= 9
        n_sent = sum(w in g.POSITIVE or w in g.NEGATIVE for w in words)
        assert n_sent in (1, 3)
        assert g.sentiment_label(text) == int(lab)
        assert "\t" not in text and "\n" not in text
    assert len({len(t) for _, t in rows}) > 10  # variable lengths: batches need padding


def test_sentiment_rows_rejects_ties():
    with pytest.raises(ValueError, match="odd"):
        g.sentiment_rows(10, sentiment_words=(2,))
    with pytest.raises(ValueError):
        g.sentiment_rows(10, min_words=5, max_words=4)


@pytest.mark.parametrize("task, fn", [("copy", g.copy_pairs), ("reverse", g.reverse_pairs), ("sort", g.sort_pairs)])
def test_sequence_pairs(task, fn):
    pairs = fn(300, seed=1, min_len=2, max_len=6)
    assert pairs == g.sequence_pairs(task, 300, seed=1, min_len=2, max_len=6)
    assert len({s for s, _ in pairs}) == 300
    for src, tgt in pairs:
        assert 2 <= len(src) <= 6 and set(src) <= set(g.DEFAULT_ALPHABET)
        assert tgt == {"copy": src, "reverse": src[::-1], "sort": "".join(sorted(src))}[task]
        assert sorted(tgt) == sorted(src)


def test_sequence_pairs_errors():
    with pytest.raises(ValueError, match="unknown sequence task"):
        g.sequence_pairs("shuffle", 3)
    with pytest.raises(ValueError, match="distinct sources"):
        g.sequence_pairs("copy", 10, min_len=1, max_len=1, alphabet="ab")


def test_split_rows_holds_out_unseen_inputs():
    pairs = g.sort_pairs(500, seed=0, min_len=3, max_len=4, alphabet="abcde")
    train, test = g.split_rows(pairs, 100, seed=0)
    assert len(test) == 100 and len(train) == 400
    assert not {s for s, _ in test} & {s for s, _ in train}
    rows = g.sentiment_rows(100)
    train, test = g.split_rows(rows, 20, seed=0, key=1)
    assert not {t for _, t in test} & {t for _, t in train}
    with pytest.raises(ValueError):
        g.split_rows(rows, 0)


def test_write_tsv_round_trips_through_the_task_reader(tmp_path):
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.tasks import classify_task, pairs_task, read_tsv

    rows = g.sentiment_rows(64, seed=0)
    assert read_tsv(g.write_tsv(rows, tmp_path / "s.tsv")) == rows
    tc = TrainConfig(batch_size=8, seq_len=64, val_fraction=0.25)
    task = classify_task(rows, tc)
    assert task.kind == "classify" and len(task.val[0]) == 16
    pairs = g.reverse_pairs(64)
    assert read_tsv(g.write_tsv(pairs, tmp_path / "p.tsv")) == pairs
    assert pairs_task(pairs, TrainConfig(batch_size=8, seq_len=9), seq2seq=True).kind == "seq2seq"
    with pytest.raises(ValueError, match="tab"):
        g.write_tsv([("a\tb", "c")], tmp_path / "bad.tsv")


def test_tiny_gpt_text_and_no_framework_import():
    assert g.TINY_GPT_TEXT == "hello world! this is a tiny gpt demo."
    # loaded on its own (jaxgpt/__init__ imports jax), the module pulls in no framework
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('gen', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.sentiment_rows(4); m.sort_pairs(4); "
            "print(sorted(x for x in ('jax', 'torch', 'numpy', 'flax') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, g.__file__], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _smoke(script: str, tmp_path: Path, name: str) -> dict:
    module = "scripts.experiments." + script.removesuffix(".py")
    p = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["smoke"] is True and result["experiment"] == name
    assert (tmp_path / "README.md").read_text().count("|") > 10
    for claim in result["claims"]:
        assert set(claim) == {"seed", "claim", "measured", "verdict"}
        v = claim["verdict"]
        assert v == "holds" or v.startswith(("holds (", "does not hold (", "not measurable here (")), v
    return result


@pytest.mark.smoke  # the script end to end in a subprocess: make test-slow
def test_exp_attention_basics_smoke(tmp_path):
    r = _smoke("exp_attention_basics.py", tmp_path, "attention_basics")
    assert {"saturation", "positions", "causal", "rope", "sampling", "claims"} <= set(r)
    for f in ("saturation", "positional_encoding", "causal_mask", "rope_relative", "sampling_temperature",
              "sampling_top_k", "top_k_vs_top_p"):
        assert (tmp_path / f"{f}.png").stat().st_size < 200_000
    # the numbers that are exact whatever the number of draws
    assert r["causal"]["mask_equals_tril"] and r["causal"]["max_weight_above_diagonal"] == 0.0
    assert r["rope"]["interleaved"]["std_distance5"] < 1e-4
    assert r["sampling"]["top_k_vs_top_p"]["flat"]["kept_top_p0.9"] == 9
    assert r["sampling"]["top_k1_draws_equal_argmax"] == 1.0


@pytest.mark.smoke
@pytest.mark.experiment  # the script end to end in a subprocess: make test-experiments
def test_exp_seed004_smoke(tmp_path):
    r = _smoke("exp_seed004.py", tmp_path, "seed004")
    assert {"minibert", "encdec", "tiny_gpt", "claims"} <= set(r)
    assert r["minibert"]["padding_mask"]["max_logit_diff_pad64_vs_pad128_with_mask"]["max"] < 1e-4
    assert "copy" in r["encdec"] and r["encdec"]["copy"]["heldout_exact_match"]["n"] >= 1
    assert r["tiny_gpt"]["summary"]["jaxgpt"]["samples"][0].startswith("h")
    for f in ("minibert_accuracy", "encdec_exact_match", "tiny_gpt_loss"):
        assert (tmp_path / f"{f}.png").exists()
