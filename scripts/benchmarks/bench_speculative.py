"""Speculative decoding speed-up: a trained 4x128 character target with a trained 1x64 draft.

    .venv/bin/python -m scripts.benchmarks.bench_speculative          # -> results/engine/speculative.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_speculative --steps 50 --tokens 32   # quick

Both models are briefly trained on Tiny Shakespeare (scripts/experiments/int8_kv.py's
``train_char_model``; random models would agree on ~1/vocab of the tokens), then 8 held-out
prompts of 32 characters are continued greedily by ``--tokens`` tokens: jaxgpt's ``generate``
with the target alone, and ``speculative_generate`` with k = 2, 4, 6 proposed tokens. Reported:
tokens/s (compile excluded: each arm runs once untimed first), speed-up, acceptance rate
(accepted / proposed draft tokens), and whether the tokens equal the target's alone.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from scripts.experiments.int8_kv import train_char_model
from scripts.harness import RESULTS, LoadSampler, timing_note, write_result


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(RESULTS / "engine" / "speculative.json"))
    a = ap.parse_args(argv)

    from jaxgpt.config import ModelConfig
    from jaxgpt.inference.generate import generate
    from jaxgpt.inference.speculative import speculative_generate

    load = LoadSampler()
    load.start()
    target_cfg = ModelConfig(vocab_size=65, d_model=128, n_layer=4, n_head=4, max_len=256, pos="rope",
                             scan_layers=False)
    draft_cfg = ModelConfig(vocab_size=65, d_model=64, n_layer=1, n_head=2, max_len=256, pos="rope",
                            scan_layers=False)
    tp, tloss, val = train_char_model(target_cfg, a.steps)
    dp, dloss, _ = train_char_model(draft_cfg, a.steps, seed=1)
    prompts = [val[i * 131:i * 131 + 32] for i in range(8)]

    def plain():
        return [np.asarray(generate(target_cfg, tp, p[None], a.tokens))[0, 32:].tolist() for p in prompts]

    def spec(k, stats):
        return [speculative_generate(target_cfg, tp, draft_cfg, dp, p, a.tokens, k=k, stats=stats) for p in prompts]

    plain()  # compile
    t0 = time.perf_counter()
    ref = plain()
    base = time.perf_counter() - t0
    rows = [dict(arm="target alone (generate)", tok_per_s=len(prompts) * a.tokens / base, speedup=1.0,
                 acceptance=None, identical="-")]
    for k in (2, 4, 6):
        spec(k, {})
        stats = {}
        t0 = time.perf_counter()
        out = spec(k, stats)
        wall = time.perf_counter() - t0
        rows.append(dict(arm=f"speculative k={k}", tok_per_s=len(prompts) * a.tokens / wall, speedup=base / wall,
                         acceptance=stats["accepted"] / stats["proposed"],
                         identical=f"{sum(o == r for o, r in zip(out, ref))}/{len(ref)}"))
    lines = ["| arm | tokens/s | speed-up | acceptance rate | greedy tokens = target alone |", "|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['arm']} | {r['tok_per_s']:.0f} | {r['speedup']:.2f}x | {acc} | {r['identical']} |")
    note = (f"Target 4x128 (train loss {tloss:.2f}), draft 1x64 (train loss {dloss:.2f}), {a.steps} AdamW steps each; "
            f"8 prompts x {a.tokens} greedy tokens, one request at a time; {timing_note(load.record())}.")
    write_result(a.out, {"rows": rows, "note": note}, "\n".join(lines) + f"\n\n{note}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
