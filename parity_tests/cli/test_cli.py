"""The command line end to end: train -> sample -> eval -> convert, one-line errors with exit
code 2 (bad settings, non-finite losses). Resume after a real kill: test_checkpoint_robust.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import require_module
from jaxgpt.cli import main
from jaxgpt.config import apply_sets, parse_value
from jaxgpt.config import TrainConfig, get_preset
from jaxgpt.train.checkpoint import Checkpoints
from jaxgpt.train.loop import prepare

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--set", "n_layer=2", "--set", "batch_size=8", "--set", "seq_len=32", "--set", "eval_batches=2"]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli") / "run"
    code = main(["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", *SMALL, "--set", "steps=30",
                 "--set", "ckpt_every=10", "--set", "keep=2", "--set", "eval_every=10", "--set", "lr=3e-3",
                 "--out", str(run), "--quiet"])
    assert code == 0
    return run


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_train_writes_metrics_checkpoints_and_plot(trained):
    losses = _losses(trained)
    assert sorted(losses) == list(range(1, 31))
    assert np.mean([losses[s] for s in range(26, 31)]) < losses[1]
    assert Checkpoints(trained, create=False).steps() == [20, 30]  # keep=2
    assert (trained / "loss.png").stat().st_size > 10_000
    vals = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in vals] == [10, 20, 30]


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_sample_eval_and_convert(trained, tmp_path, capsys):
    assert main(["sample", "--ckpt", str(trained), "--prompt", "abc", "--temperature", "0", "1.0",
                 "--max-new-tokens", "12", "--top-k", "5"]) == 0
    out = capsys.readouterr().out
    assert "--- greedy ---\nabc" in out and "--- temperature 1.0 ---\nabc" in out
    greedy = out.split("--- greedy ---\n")[1].splitlines()[0]
    assert len(greedy) == 3 + 12

    assert main(["eval", "--ckpt", str(trained), "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["val_ppl"] == pytest.approx(np.exp(result["val_loss"]))
    last_val = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line][-1]
    assert result["val_loss"] == pytest.approx(last_val["val_loss"], rel=1e-6)  # same batches, same weights

    # jaxgpt checkpoint -> torch_ref .pt -> jaxgpt checkpoint -> safetensors: the weights survive
    config, params, _ = Checkpoints(trained, create=False).restore_params()
    assert main(["convert", str(trained), str(tmp_path / "model.pt")]) == 0
    assert main(["convert", str(tmp_path / "model.pt"), str(tmp_path / "again")]) == 0
    assert main(["convert", str(tmp_path / "again"), str(tmp_path / "model.safetensors")]) == 0
    from jaxgpt.convert import load_safetensors

    config2, params2 = load_safetensors(str(tmp_path / "model.safetensors"))
    assert config2 == config
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)))
    # the tokenizer travelled too: the converted checkpoint samples the same greedy text
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(tmp_path / "again"), "--prompt", "abc", "--temperature", "0",
                 "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.split("--- greedy ---\n")[1].splitlines()[0] == greedy


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_convert_to_hugging_face(tmp_path):
    require_module("transformers")
    run = tmp_path / "llama"
    assert main(["train", "--preset", "llama-tiny", "--corpus", "seed-synthetic", *SMALL, "--set", "steps=2",
                 "--set", "d_model=32", "--set", "n_head=4", "--set", "n_kv_head=2", "--set", "d_ff=64",
                 "--out", str(run), "--quiet"]) == 0
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back.safetensors")]) == 0
    from jaxgpt.convert import load_safetensors

    _, params = load_safetensors(str(tmp_path / "back.safetensors"))
    _, ours, _ = Checkpoints(run, create=False).restore_params()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params)))


# Resume after a real SIGKILL, bit for bit: test_checkpoint_robust.py kills three runs during a save
# (and after it) and reruns the same command, comparing every logged loss with an uninterrupted run.


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_resume_refuses_changed_settings(trained):
    config, tc = apply_sets(get_preset("seed-minigpt"), ["n_layer=2", "batch_size=8", "seq_len=32", "eval_batches=2",
                                                         "steps=30", "ckpt_every=10", "keep=2", "eval_every=10",
                                                         "lr=3e-3"])
    assert prepare(trained, config, tc, corpus="seed-synthetic")[3] is not None  # same settings: resumes
    with pytest.raises(ValueError, match=r"lr=0.001 \(saved: 0.003\)"):
        prepare(trained, config, tc.replace(lr=1e-3), corpus="seed-synthetic")
    with pytest.raises(ValueError, match="n_layer=3"):
        prepare(trained, config.replace(n_layer=3), tc, corpus="seed-synthetic")


def test_set_values_and_targets():
    assert [parse_value(v) for v in ("3", "1e-3", "true", "None", "rope")] == [3, 1e-3, True, None, "rope"]
    config, tc = apply_sets(get_preset("seed-transformer"), ["d_model=32", "decoder.n_layer=2", "steps=7",
                                                             "out_bias=false"])
    assert (config.encoder.d_model, config.decoder.d_model, config.encoder.n_layer, config.decoder.n_layer) == \
        (32, 32, 1, 2)
    assert config.out_bias is False and tc == TrainConfig(steps=7)
    bert, _ = apply_sets(get_preset("seed-minibert"), ["n_classes=3", "n_layer=1"])
    assert bert.n_classes == 3 and bert.encoder.n_layer == 1
    # string fields keep the text: 'none' is a value of pos, not None
    gpt, tc = apply_sets(get_preset("seed-minigpt"), ["pos=none", "on_nonfinite=skip", "grad_clip=none"])
    assert gpt.pos == "none" and tc.on_nonfinite == "skip" and tc.grad_clip is None


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_nonfinite_loss_stops_training_with_exit_2(tmp_path, capsys):
    run = tmp_path / "nan"
    argv = ["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "n_layer=1", "--set",
            "d_model=32", "--set", "d_ff=64", "--set", "batch_size=4", "--set", "seq_len=16", "--set", "steps=10",
            "--set", "lr=1e30", "--set", "schedule=constant", "--set", "grad_clip=none", "--set", "eval_every=0",
            "--out", str(run), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxgpt train: error: non-finite gradient at step 2 (loss ") and err.count("\n") == 1
    assert "no checkpoint saved" in err and "set on_nonfinite=skip" in err
    assert not Checkpoints(run, create=False).steps()


@pytest.mark.parametrize("argv, message", [
    (["train", "--preset", "gpt5", "--corpus", "seed-synthetic", "--out", "x"], "unknown preset 'gpt5'; available:"),
    (["train", "--preset", "seed-minigpt", "--data", "/no/such.txt", "--out", "x"], "no text file at '/no/such.txt'"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "lr", "--out", "x"],
     "--set expects key=value, got 'lr'"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "learning_rate=1", "--out", "x"],
     "unknown setting 'learning_rate'"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "n_head=3", "--out", "x"],
     "d_model=64 is not divisible by n_head=3"),
    (["train", "--preset", "seed-minigpt", "--corpus", "nope", "--out", "x"], "unknown corpus 'nope'"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "lr=abc", "--out", "x"],
     "jaxgpt train: error: lr must be a float, got 'abc' (str)\n"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "steps=1.5", "--out", "x"],
     "jaxgpt train: error: steps must be an int, got 1.5 (float)\n"),
    (["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "tie_embeddings=2", "--out", "x"],
     "jaxgpt train: error: tie_embeddings must be a bool, got 2 (int)\n"),
    (["sample", "--ckpt", "/no/such/run"], "no checkpoints at '/no/such/run'"),
    (["convert", "/no/such.pt", "x.safetensors"], "no file or directory at '/no/such.pt'"),
])
def test_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(Exception):  # noqa: B017 - --debug re-raises whatever the command raised, of any type
        main(["--debug", *argv])


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_a_second_run_loads_every_compiled_program(tmp_path):
    """$JAXGPT_COMPILE_CACHE (jaxgpt.cli.compile_cache): the first run fills the cache; a second run of
    the same model on the same two host devices finds every program it compiled (the init, the train
    program, the eval step split over the devices: no new entry), and trains to the same losses."""
    cache = tmp_path / "xla"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXGPT_COMPILE_CACHE": str(cache)}
    sets = ["n_layer=2", "d_model=64", "n_head=2", "dropout=0.0", "max_len=32", "seq_len=32", "batch_size=8",
            "steps=3", "eval_every=3", "eval_batches=2"]
    cmd = [sys.executable, "-m", "jaxgpt", "train", "--preset", "gpt2-shakespeare-char", "--corpus", "seed-synthetic",
           "--quiet"] + [a for s in sets for a in ("--set", s)]
    entries = []
    for name in ("cold", "warm"):
        proc = subprocess.run(cmd + ["--out", str(tmp_path / name)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        entries.append(sorted(p.name for p in cache.iterdir()))
    assert any(n.startswith("jit_eval_step_split") for n in entries[0]), entries[0]
    # one train program, compiled on fit's compile_ahead thread and loaded by the first call: a lowering
    # there unlike the real call's would have left a second entry
    assert sum(n.startswith("jit_train_steps-") for n in entries[0]) == 1, entries[0]
    assert sorted(set(entries[1]) - set(entries[0])) == []
    assert _losses(tmp_path / "warm") == _losses(tmp_path / "cold")


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_console_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "jaxgpt", "train", "--preset", "nope", "--corpus", "zh-en",
                           "--out", "x"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.startswith("jaxgpt train: error: unknown preset 'nope'")


@pytest.mark.e2e  # the command line end to end: make test-slow
def test_bpe_tokenizer_run_and_bench_json(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    run = tmp_path / "bpe"
    assert main(["train", "--preset", "seed-minigpt", "--data", str(text), *SMALL, "--set", "steps=2",
                 "--set", "tokenizer=bpe", "--set", "bpe_vocab=300", "--out", str(run), "--quiet"]) == 0
    meta = Checkpoints(run, create=False).meta()
    assert meta["tokenizer"]["kind"] == "bpe" and 256 < meta["config"]["vocab_size"] <= 300
    assert main(["bench", "--preset", "seed-minigpt", "--set", "n_layer=1", "--batch-size", "2", "--seq-len", "16",
                 "--steps", "1", "--new-tokens", "4", "--json", str(tmp_path / "bench.json")]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["train_tok_s"] > 0 and result["decode_cached_tok_s"] > 0
    assert "train step" in capsys.readouterr().out
