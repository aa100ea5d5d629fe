"""One check of an HF decoder family everywhere LLaMA runs (issue 53's done-when, per family).

``check_family(hf_model, tmp_path, name)`` takes a transformers causal LM built from its config class
(random weights, perturbed to unit scale by the caller or by ``perturb``) and checks, against
references the test did not compute (transformers' own forward and greedy ``generate``):

- ``load_hf`` of its ``save_pretrained`` directory: logits within 1e-5 (float32);
- ``save_hf`` of those params: transformers loads the directory, its logits within 1e-5 of ours;
- ``jaxgpt.tools.parity.run(..., grads=True)``: every layer, the logits, the gradients and one AdamW
  step within 1e-5, and its cached / uncached / torch generations equal;
- greedy ``jaxgpt.inference.generate`` (KV cache) and the paged ``Engine``: the tokens of
  transformers' greedy ``generate`` on prompts of ``prompt_lens`` tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from conftest import assert_close
from jaxgpt import build
from jaxgpt.convert import load_hf, save_hf
from jaxgpt.inference.engine import Engine
from jaxgpt.inference.generate import generate
from jaxgpt.inference.sampling import SamplingParams
from jaxgpt.tools.parity import format_table, run

TOL = 1e-5


def perturb(model, seed=0, scale=1.0):
    """Unit-scale weights (norms and biases moved off 1 / 0), so 1e-5 is a meaningful bound; ``scale``
    < 1 keeps deep or wide models' greedy tokens away from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]) + (p if p.ndim == 1 else 0))
    return model.eval()


def hf_greedy(model, prompt, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def check_family(hf, tmp_path: Path, name: str, *, prompt_lens=(5, 19), new_tokens: int = 8, seq_len: int = 24,
                 grads: bool = True, engine_kw: dict | None = None):
    """Every path above for one HF model; returns (config, params). ``seq_len``: the forward's length
    (longer than any sliding window, so the window is exercised)."""
    vocab = hf.config.vocab_size
    hf.save_pretrained(tmp_path / "hf")
    config, params = load_hf(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, vocab, (2, seq_len))
    ours = np.asarray(build(config).apply({"params": params}, ids))
    assert_close(ours, hf_logits(hf, ids), f"load_hf {name}")

    save_hf(tmp_path / "ours", config, params)
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert_close(ours, hf_logits(back, ids), f"save_hf {name} -> from_pretrained")

    report = run(tmp_path / "hf", grads=grads, seq_len=seq_len, generate=6)
    assert report["ok"] and report["first_bad_layer"] is None, format_table(report)
    if grads:
        assert report["grads"]["ok"] and report["grads"]["scaled"] <= TOL and report["adamw"]["scaled"] <= TOL
    gen = report["generate"]
    assert gen["cached"] == gen["uncached"] == gen["torch"], gen

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lens]
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    own = [np.asarray(generate(config, params, np.array([p]), new_tokens))[0, len(p):].tolist() for p in prompts]
    assert own == want, f"{name}: generate vs transformers greedy"
    eng = Engine(config, params, page_size=8, **{"max_seqs": 4, "max_tokens_per_step": 32, "num_pages": 24,
                                                 **(engine_kw or {})})
    got = eng.generate(prompts, [SamplingParams(max_tokens=new_tokens) for _ in prompts])
    assert got == want, f"{name}: engine vs transformers greedy"
    return config, params
