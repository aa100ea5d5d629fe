"""`jaxgpt parity` (jaxgpt.tools.parity) on every supported source: HF GPT-2 / LLaMA / BERT directories,
a nanoGPT ckpt.pt and a torch_ref .pt, in float32 at 1e-5 (and bfloat16 at its own 5e-2); and it
catches deliberately broken converters, naming the first bad layer and exiting 1."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import randomize
from parity_tests.hf_dirs import bert_dir, gpt2_dir, llama_dir, nanogpt_ckpt
from jaxgpt.cli import main
from jaxgpt.tools.parity import format_table, run

TOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {"gpt2": gpt2_dir(root / "gpt2"), "llama": llama_dir(root / "llama"), "bert": bert_dir(root / "bert")}


def assert_passes(report, n_layer=2):
    assert len(report["layers"]) == n_layer and report["first_bad_layer"] is None, format_table(report)
    assert all(r["scaled"] <= TOL for r in report["layers"]) and report["logits"]["scaled"] <= TOL
    assert report["logits"]["top1"] == 1.0 and report["logits"]["kl"] < 1e-10
    assert report["ok"], format_table(report)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_decoders_pass_with_grads_adamw_and_generation(dirs, family):
    report = run(dirs[family], grads=True, generate=6)
    assert_passes(report)
    assert report["grads"]["ok"] and report["grads"]["scaled"] <= TOL and report["adamw"]["scaled"] <= TOL
    gen = report["generate"]
    assert gen["cached"] == gen["uncached"] == gen["torch"] and len(gen["torch"]) == 6


def test_hf_bert_padded_batch_and_its_padding_idx_gradient(dirs):
    report = run(dirs["bert"], grads=True, batch=3)
    assert report["input_shape"] == [3, 16] and "generate" not in report
    assert report["first_bad_layer"] is None and report["logits"]["scaled"] <= TOL
    # HF's word_embeddings(padding_idx=0) never gets a gradient in row 0; the import keeps pad_token_id=0,
    # so neither does jaxgpt's: every gradient within tolerance, nothing left to note
    assert not report["grads"]["over_tol"] and report["grads"]["notes"] == [] and report["ok"]


def test_nanogpt_checkpoint(tmp_path):
    assert_passes(run(nanogpt_ckpt(tmp_path / "ckpt.pt", bias=False, compiled=True), grads=True, generate=4))


def test_torch_ref_file(tmp_path):
    from jaxgpt.config import PRESETS
    from jaxgpt.convert.files import save_weights
    from jaxgpt.models import init_params

    config = PRESETS["seed-minigpt"].replace(n_layer=2, vocab_size=50, max_len=32)
    save_weights(tmp_path / "m.pt", "torch", config, randomize(init_params(config, jax.random.PRNGKey(0))))
    report = run(tmp_path / "m.pt", generate=4)
    assert report["kind"] == "torch_ref"
    assert_passes(report)
    assert report["generate"]["cached"] == report["generate"]["uncached"] == report["generate"]["torch"]


def test_bfloat16_has_its_own_tolerance(dirs):
    report = run(dirs["llama"], dtype="bfloat16", generate=0)
    assert report["tol"] == 5e-2 and report["ok"], format_table(report)
    worst = max(r["scaled"] for r in report["layers"] + [report["logits"]])
    assert 1e-5 < worst < 5e-2  # bfloat16 rounding is visible, and bounded


def _swap_kv_in_layer(monkeypatch, layer):
    from jaxgpt.convert import llama

    real = llama.params_from_hf

    def broken(*a, **k):
        p = real(*a, **k)
        attn = p["layers"]["attn"]
        for leaf in ("kernel",):
            kk, vv = np.array(attn["k_proj"][leaf]), np.array(attn["v_proj"][leaf])
            kk[layer], vv[layer] = vv[layer].copy(), kk[layer].copy()
            attn["k_proj"][leaf], attn["v_proj"][leaf] = kk, vv
        return p

    monkeypatch.setattr(llama, "params_from_hf", broken)


def test_catches_swapped_kv_and_names_the_first_bad_layer(tmp_path, monkeypatch, capsys):
    d = llama_dir(tmp_path / "llama3", n_layer=3)
    _swap_kv_in_layer(monkeypatch, 1)
    assert main(["parity", str(d), "--json", str(tmp_path / "r.json"), "--generate", "4"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FAIL: first layer above tolerance: layer 1")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_bad_layer"] == 1 and report["layers"][0]["ok"] and not report["layers"][1]["ok"]
    assert report["logits"]["scaled"] > 1e-3 and not report["ok"]
    gen = report["generate"]  # the broken model also decodes other tokens than torch's generate
    assert not gen["ok"] and gen["first_mismatch_cached"] is not None and gen["cached"] != gen["torch"]


def test_catches_wrong_rope_layout(dirs, monkeypatch):
    from jaxgpt.convert import llama

    real = llama.config_from_hf
    monkeypatch.setattr(llama, "config_from_hf", lambda *a, **k: real(*a, **k).replace(rope_layout="interleaved"))
    report = run(dirs["llama"], generate=0)
    assert report["first_bad_layer"] == 0 and not report["ok"]


def test_cli_prompt_json_and_errors(dirs, tmp_path, capsys):
    assert main(["parity", str(dirs["gpt2"]), "--prompt", "the cat sat on the mat", "--generate", "3",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "layer 1" in out and "top-1 agreement 100.0%" in out and out.rstrip().endswith("PASS")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["input_shape"][0] == 1 and report["ok"] and report["generate"]["new_tokens"] == 3
    from jaxgpt.convert.files import save_safetensors

    save_safetensors(tmp_path / "w.safetensors", {"a": np.zeros(2, np.float32)})
    assert main(["parity", str(tmp_path / "w.safetensors")]) == 2
    assert "compares a torch checkpoint" in capsys.readouterr().err
    assert main(["parity", str(dirs["llama"]), "--prompt", "hi"]) == 2
    assert "--prompt needs a tokenizer.json" in capsys.readouterr().err


def test_importing_jaxgpt_parity_stays_torch_free():
    import subprocess
    import sys

    code = ("import sys, jaxgpt, jaxgpt.tools.parity, jaxgpt.data.hf_tokenizer, jaxgpt.convert.torch_nn; "
            "sys.exit(any(m in sys.modules for m in ('torch', 'torch_ref', 'transformers')))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_run_puts_jax_and_torch_global_settings_back(dirs, monkeypatch):
    """run() compares at full precision (JAX 'highest', no TF32 in torch, torch seeded) and leaves
    JAX's and torch's global settings, and torch's random state, as it found them: after a normal
    return and after an error."""
    import torch

    from jaxgpt.tools import parity

    flags = parity._torch_flags(torch)
    new_api = flags[0][1] == "fp32_precision"
    seen = []
    real = parity.torch_forward

    def spy(side, inputs, **kw):  # the settings while run() compares
        seen.append((jax.config.jax_default_matmul_precision, [getattr(o, a) for o, a in flags]))
        return real(side, inputs, **kw)

    def state():
        return jax.config.jax_default_matmul_precision, [getattr(o, a) for o, a in flags], torch.get_rng_state()

    saved = jax.config.jax_default_matmul_precision, [getattr(o, a) for o, a in flags]
    try:  # a caller's own global settings, unlike the ones run() needs
        jax.config.update("jax_default_matmul_precision", "bfloat16")
        for o, a in flags:
            setattr(o, a, "tf32" if new_api else True)
        torch.manual_seed(1234)
        monkeypatch.setattr(parity, "torch_forward", spy)
        before = state()
        assert run(dirs["gpt2"], generate=0)["ok"]
        assert seen == [("highest", ["ieee" if new_api else False] * len(flags))]
        after = state()
        assert after[:2] == before[:2] == ("bfloat16", ["tf32" if new_api else True] * len(flags))
        assert torch.equal(after[2], before[2]), "run() left torch's random state changed"

        def boom(*a, **k):
            torch.manual_seed(99)
            raise RuntimeError("torch side failed")

        monkeypatch.setattr(parity, "torch_forward", boom)
        with pytest.raises(RuntimeError, match="torch side failed"):
            run(dirs["gpt2"], generate=0)
        after = state()
        assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    finally:
        jax.config.update("jax_default_matmul_precision", saved[0])
        for (o, a), v in zip(flags, saved[1]):
            setattr(o, a, v)
