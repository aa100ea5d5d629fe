"""The README is a newcomer's first page: short, free of dated project history, licensed, and every
Python snippet in it runs as written (in a fresh interpreter in a temporary directory holding the
``tiny-llama`` Hugging Face directory the snippets name). The snippets and the examples/ scripts run in
the e2e tier (make test-slow, CI)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import require_module, require_shared
from parity_tests.hf_dirs import llama_dir

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 220
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a commit hash: 7-40 hex characters with both a digit and a letter (so no plain word or number)
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def python_blocks(text: str) -> list[str]:
    return PYTHON_BLOCK.findall(text)


def test_readme_is_short_and_tells_no_history():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert not DATE.findall(text), "dated narrative belongs in docs/history.md"
    assert not HASH.findall(text), "commit hashes belong in docs/history.md"


def test_license_file_matches_the_package_metadata():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "MIT"


def test_the_history_checks_catch_a_date_and_a_hash():
    assert DATE.findall("green on 2026-11-27") and HASH.findall("a fresh clone of 2d4c490")
    assert not HASH.findall("decade 1234567 facade")


RUN_BLOCKS = """
import sys, traceback
for i, block in enumerate(sys.argv[1:]):
    try:
        exec(compile(block, f"README python block {i}", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README python block {i} failed")
"""


@pytest.mark.e2e
def test_readme_python_snippets_run(tmp_path):
    """Each block in a namespace of its own, as a reader pastes it, in one fresh interpreter."""
    require_module("transformers")
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3, "the README shows inference, an own loop and an HF round trip"
    llama_dir(tmp_path / "tiny-llama", tokenizer=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", RUN_BLOCKS, *blocks], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "tiny-llama-ft" / "tokenizer.json").is_file()


def _run_example(script: str, *args: str) -> list[float]:
    """Run examples/<script> on Tiny Shakespeare; the training losses it printed."""
    text = require_shared(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt", "Tiny Shakespeare")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, "--text", str(text)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [float(v) for v in re.findall(r"train (\d+\.\d+)", run.stdout)]


@pytest.mark.e2e
def test_own_loop_example_learns():
    losses = _run_example("own_loop.py", "--steps", "120")
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, losses


@pytest.mark.e2e
def test_hf_finetune_example_learns_and_exports_what_transformers_reads(tmp_path):
    transformers = require_module("transformers")
    src, out = llama_dir(tmp_path / "hf", tokenizer=True), tmp_path / "ft"
    losses = _run_example("hf_finetune.py", str(src), str(out), "--steps", "60")
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.5, losses
    before, after = (transformers.AutoTokenizer.from_pretrained(d) for d in (src, out))
    for text in ("the cat sat", "  two  spaces\tand\nlines", "caf\u00e9 \u732b", "<s>the end</s>"):
        assert after(text).input_ids == before(text).input_ids, text
    assert (after.bos_token_id, after.eos_token_id) == (before.bos_token_id, before.eos_token_id)
    transformers.AutoModelForCausalLM.from_pretrained(out)
