"""Hugging Face directories in the command line: tokenizer.json through `tokenizers` with special ids
from config.json / generation_config.json, and `sample`, `eval`, `convert`, `train --init` on a
tiny locally saved GPT-2 directory (greedy text equal to transformers' generate)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from parity_tests.hf_dirs import TEXT, gpt2_dir
from jaxgpt.cli import main
from jaxgpt.data.hf_tokenizer import HFTokenizer, special_ids

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return gpt2_dir(tmp_path_factory.mktemp("hf") / "gpt2")


def hf_greedy(path, prompt, n, eos=None):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = GPT2LMHeadModel.from_pretrained(path, local_files_only=True).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    return tok.decode(out[0], skip_special_tokens=True), out[0, ids.shape[1]:].tolist()


def greedy_text(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out.split("--- greedy ---\n")[1].rstrip("\n")


def test_tokenizer_matches_transformers_and_reads_special_ids(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    tok = HFTokenizer.from_dir(hf_dir)
    text = "the dog met a cat, naïvely: 猫!"
    assert tok.encode(text).tolist() == ref(text).input_ids
    assert tok.decode(tok.encode(text)) == ref.decode(ref(text).input_ids) == text
    assert tok.vocab_size == 320 and tok.eos_id == 0
    # generation_config.json wins over config.json, and a list of eos ids is kept whole
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1, "vocab_size": 320}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert special_ids(tmp_path) == {"bos_token_id": [1], "eos_token_id": [7, 9]}
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json has .* tokens but the model's vocab_size is 10"):
        HFTokenizer(tok.to_dict()["json"], vocab_size=10)
    assert HFTokenizer.from_dict(tok.to_dict()).encode(text).tolist() == tok.encode(text).tolist()


def test_sample_from_hf_dir_equals_transformers_generate(hf_dir, capsys):
    want, _ = hf_greedy(hf_dir, PROMPT, 12)
    got = greedy_text(capsys, ["sample", "--ckpt", str(hf_dir), "--prompt", PROMPT, "--temperature", "0",
                               "--max-new-tokens", "12"])
    assert got == want and got.startswith(PROMPT) and len(got) > len(PROMPT)


def test_sample_stops_at_generation_config_eos(hf_dir, tmp_path, capsys):
    import shutil

    full, new = hf_greedy(hf_dir, PROMPT, 6)
    d = shutil.copytree(hf_dir, tmp_path / "eos")
    stop = new[2]  # make the 3rd greedy token the EOS: generation ends at its first occurrence
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    want, _ = hf_greedy(d, PROMPT, 6, eos=stop)
    got = greedy_text(capsys, ["sample", "--ckpt", str(d), "--prompt", PROMPT, "--temperature", "0",
                               "--max-new-tokens", "6"])
    assert got == want and len(got) < len(full)
    tok = HFTokenizer.from_dir(d)
    assert got == tok.decode([*tok.encode(PROMPT), *new[:new.index(stop) + 1]])


@pytest.mark.e2e  # convert, eval and fine-tune runs through the command line: make test-slow
def test_convert_eval_and_finetune_from_hf_dir(hf_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["convert", str(hf_dir), str(ckpt)]) == 0
    capsys.readouterr()
    args = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "8"]
    from_ckpt = greedy_text(capsys, ["sample", "--ckpt", str(ckpt), *args])  # the tokenizer came along
    assert from_ckpt == greedy_text(capsys, ["sample", "--ckpt", str(hf_dir), *args])

    data = tmp_path / "text.txt"
    data.write_text(TEXT * 4)  # eval uses the default seq_len 64 on the 10% validation split
    assert main(["eval", "--ckpt", str(hf_dir)]) == 2
    assert "records no training data" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(hf_dir), "--data", str(data), "--batches", "1",
                 "--json", str(tmp_path / "e.json")]) == 0
    before = json.loads((tmp_path / "e.json").read_text())["val_loss"]
    assert np.isfinite(before) and before > 1.0

    run = tmp_path / "ft"  # lr 1e-12: the run must start from (and keep) the HF weights
    train = ["train", "--init", str(hf_dir), "--data", str(data), "--set", "steps=3", "--set", "batch_size=4",
             "--set", "seq_len=16", "--set", "eval_batches=1", "--set", "lr=1e-12", "--out", str(run), "--quiet"]
    assert main(train) == 0
    assert f"from {hf_dir}" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3
    assert main(train) == 0  # rerun: resumes at the end, nothing retrained
    assert "resuming at step 3" in capsys.readouterr().out
    assert greedy_text(capsys, ["sample", "--ckpt", str(run), *args]) == from_ckpt
    assert main(["train", "--init", str(hf_dir), "--data", str(data), "--set", "n_layer=1",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--set changes the shapes" in capsys.readouterr().err


def test_hf_dir_without_tokenizer_asks_for_ids(tmp_path, capsys):
    d = gpt2_dir(tmp_path / "bare", tokenizer=False)
    assert main(["sample", "--ckpt", str(d), "--prompt", "x"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(d), "--prompt-ids", "1,2,3", "--temperature", "0",
                 "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.split("--- greedy ---\n")[1].startswith("1,2,3,")
