"""The main job: train seed 000's MiniGPT on its built-in character corpus, then sample.

Equivalent to

    jaxgpt train --preset seed-minigpt --corpus seed-synthetic --set lr=1e-3 --set warmup_steps=50 --out runs/demo
    jaxgpt sample --ckpt runs/demo --prompt abcde --temperature 0 0.5 1.0 --max-new-tokens 60

The seed's own schedule (lr 3e-4, no warmup) reaches a loss of about 1.43 after 500 steps; it
trains for 15 epochs (~12,000 steps). A 1e-3 peak with 50 warmup steps gets to ~0.10 in 500.
Rerunning resumes from runs/demo (a finished run only samples again); delete it to start over.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxgpt.cli import main

OUT = Path(__file__).resolve().parent.parent / "runs" / "demo"


def run(argv: list[str]) -> None:
    code = main(argv)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run(["train", "--preset", "seed-minigpt", "--corpus", "seed-synthetic", "--set", "lr=1e-3",
         "--set", "warmup_steps=50", "--out", str(OUT)])
    for prompt in ("abcde", "the cat"):
        print(f"\nprompt {prompt!r}")
        run(["sample", "--ckpt", str(OUT), "--prompt", prompt, "--temperature", "0", "0.5", "1.0",
             "--max-new-tokens", "60"])
    rows = [json.loads(line) for line in (OUT / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    final = sum(losses[-20:]) / len(losses[-20:])
    print(f"\nfinal training loss {final:.4f} (mean of the last 20 steps; the seed expects < 1.5)")
    print(f"loss curve: {OUT / 'loss.png'}")
    if final >= 1.5:
        sys.exit(f"final loss {final:.4f} is not below 1.5")
