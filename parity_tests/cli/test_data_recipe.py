"""docs/data.md's GPT-2 124M recipe, run as written on a tiny corpus: the commands are read from
the doc's recipe block and only their paths and sizes are swapped for toy ones (a saved
`datasets` dataset of 8,000 short documents, a byte-level BPE `tokenizer.json` with <|endoftext|>
trained here, --mesh data=2 on 2 host devices, a 1-layer d_model=32 gpt2-small for 4 updates)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import require_module, xla_flags

pytestmark = pytest.mark.smoke
REPO = Path(__file__).resolve().parents[2]
TOY_SETS = ["n_layer=1", "d_model=32", "n_head=2", "seq_len=16", "batch_size=4", "grad_accum=1", "steps=4",
            "warmup_steps=1", "eval_every=2", "eval_batches=1", "ckpt_every=2"]


def recipe_commands() -> list[list[str]]:
    text = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- recipe:.*?-->\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/data.md lost its recipe block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.startswith("jaxgpt ")]


def test_gpt2_recipe_runs_on_a_tiny_corpus(tmp_path):
    datasets = require_module("datasets")
    require_module("tokenizers")
    from jaxgpt.data import train_bpe

    words = "the of and a to in is was that for on with as by it at from his an were are which".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, rng.integers(5, 30))).capitalize() + "." for _ in range(8000)]
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "owt"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "tokenizer.json").write_text(
        train_bpe("\n".join(docs[:500]), 320, special_tokens=["<|endoftext|>"]).to_dict()["json"])

    swap = {"owt": str(tmp_path / "owt"), "gpt2": str(tmp_path / "gpt2"), "data/owt": str(tmp_path / "data"),
            "runs/gpt2": str(tmp_path / "run"), "data=8": "data=2", "8": "2"}
    commands = recipe_commands()
    assert [c[1] for c in commands] == ["prepare", "train", "eval", "sample"]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    outputs = []
    for cmd in commands:
        args = [swap.get(a, a) for a in cmd[1:]]
        if args[0] == "train":
            args += [x for s in TOY_SETS for x in ("--set", s)] + ["--quiet"]
        p = subprocess.run([sys.executable, "-m", "jaxgpt", *args], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=300)
        assert p.returncode == 0, f"{' '.join(args)}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        outputs.append(p.stdout)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "hf" and meta["eos_token"] == "<|endoftext|>"
    assert meta["documents"]["train"] + meta["documents"]["val"] == 8000 and meta["documents"]["val"] > 0
    assert "lm on" in outputs[1] and "4 steps of 4x16" in outputs[1]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert "validation split, 1 batches" in outputs[2]
    assert "The meaning of life is" in outputs[3]
