"""Speculative decoding speed-up: a trained character target (4x512) with a trained 1x64 draft.

    .venv/bin/python -m scripts.benchmarks.bench_speculative          # -> results/engine/speculative.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_speculative --steps 20 --tokens 16 --ks 2 --target 2x64 --rounds 1
    .venv/bin/python -m scripts.benchmarks.bench_speculative --in-flight 1,2,4,8 --ks 4 --no-offline \
        --spec-max-batch 8,auto          # always-on against the auto rule (and the target alone)
    .venv/bin/python -m scripts.benchmarks.bench_speculative --in-flight 1,2,4,8 --ks 6 --no-offline \
        --spec-max-batch 8,auto --draft-steps 10   # a weak draft: speculation loses at a large batch

Both models are briefly trained on Tiny Shakespeare (scripts/experiments/int8_kv.py's
``train_char_model``; random models would agree on ~1/vocab of the tokens), then 8 held-out
prompts of 32 characters are continued greedily by ``--tokens`` tokens, in two settings:

- the engine (``Engine``, what ``jaxgpt serve`` runs), with the 8 requests in flight together and
  with one request at a time: the target alone against ``Engine(draft=...)`` with k proposals, an
  arm for each ``--spec-max-batch`` rule (8: speculate at every batch size measured here; auto: the
  engine's measured rule, spec_policy.py, which also reports the share of decode steps it
  speculated);
- offline, one request at a time: ``generate()`` against ``speculative_generate`` (host-driven rounds).

Reported: output tokens/s (every program compiled before timing: ``Engine.precompile()``, or an
untimed first run), speed-up against the target alone in the same setting, acceptance rate
(accepted / proposed draft tokens), and whether the tokens equal the target's alone. The arms
alternate over ``--rounds`` and each reports its median.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxgpt.cli.serve import spec_max_batch
from scripts.experiments.int8_kv import train_char_model
from scripts.harness import RESULTS, LoadSampler, timing_note, write_result


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--draft-steps", type=int, help="the draft's training steps (default --steps): fewer give a pair "
                                                    "that agrees less, where speculation loses at a large batch")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ks", default="2,4,6", help="proposals a round, comma-separated")
    ap.add_argument("--target", default="4x512", help="target layers x width (the draft is 1x64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target-lr", type=float, default=3e-3,
                    help="the target's learning rate (the draft's is 3e-3): at 3e-3 a 4x512 target stalls near "
                         "loss 2.5, above its 1x64 draft, and its greedy text is easy to predict (acceptance 0.92-0.96)")
    ap.add_argument("--in-flight", default="8,1", help="engine arms: requests in flight together, comma-separated "
                                                       "(1 = one at a time); 1,2,4,8 finds the crossover batch size")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline (speculative_generate) arms")
    ap.add_argument("--spec-max-batch", default="8", help="the draft engine arms' rules, comma-separated: an int "
                                                         "(speculate while at most that many requests run; 8 = "
                                                         "always here) or auto (the measured rule)")
    ap.add_argument("--out", default=str(RESULTS / "engine" / "speculative.json"))
    a = ap.parse_args(argv)
    try:
        rules = [spec_max_batch(r) for r in a.spec_max_batch.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--spec-max-batch: {e}")

    from jaxgpt.config import ModelConfig
    from jaxgpt.inference.engine import Engine
    from jaxgpt.inference.generate import generate
    from jaxgpt.inference.sampling import SamplingParams
    from jaxgpt.inference.speculative import speculative_generate

    load = LoadSampler()
    load.start()
    layers, width = (int(x) for x in a.target.split("x"))
    target_cfg = ModelConfig(vocab_size=65, d_model=width, n_layer=layers, n_head=max(1, width // 64), max_len=128,
                             pos="rope")  # the engine decodes separate layers
    draft_cfg = ModelConfig(vocab_size=65, d_model=64, n_layer=1, n_head=2, max_len=128, pos="rope")
    tp, tloss, val = train_char_model(target_cfg, a.steps, batch=8, lr=a.target_lr)
    draft_steps = a.steps if a.draft_steps is None else a.draft_steps
    dp, dloss, _ = train_char_model(draft_cfg, draft_steps, seed=1, batch=8)
    prompts = [val[i * 131:i * 131 + 32].tolist() for i in range(8)]
    ks = [int(k) for k in a.ks.split(",")]
    greedy = SamplingParams(max_tokens=a.tokens, ignore_eos=True)

    def engine(k, rule):
        # rule 8: speculate at every batch size measured here; 'auto': the engine's measured rule decides
        eng = Engine(target_cfg, tp, max_seqs=8, page_size=16, max_tokens_per_step=64, spec_max_batch=rule,
                     draft=None if k == 0 else (draft_cfg, dp), num_speculative_tokens=max(k, 1))
        eng.precompile()
        return eng

    # an auto engine keeps its measurements across rounds (a server's would): its warm-up run is the first
    engines = {(0, 8): engine(0, 8)} | {(k, r): engine(k, r) for k in ks for r in rules}
    on_share = {}  # (k, rule, in flight) -> the share of decode steps that speculated, in the timed runs

    def run_engine(k, rule, together):
        eng = engines[k, rule]
        before = dict(eng.stats)
        out = [o for i in range(0, len(prompts), together) for o in eng.generate(prompts[i:i + together], greedy)]
        if not k:
            return out, None
        d = {key: eng.stats[key] - before[key] for key in ("spec_accepted", "spec_proposed", "spec_rounds",
                                                           "spec_off_steps")}
        on_share.setdefault((k, rule, together), []).append(d["spec_rounds"] / max(1, d["spec_rounds"]
                                                                                      + d["spec_off_steps"]))
        return out, (d["spec_accepted"], d["spec_proposed"])

    def run_offline(k):
        if k == 0:
            return [np.asarray(generate(target_cfg, tp, np.array([p]), a.tokens))[0, 32:].tolist() for p in prompts], None
        stats = {}
        out = [speculative_generate(target_cfg, tp, draft_cfg, dp, np.array(p), a.tokens, k=k, stats=stats)
               for p in prompts]
        return out, (stats["accepted"], stats["proposed"])

    flights = [int(n) for n in a.in_flight.split(",")]
    # (setting, k, rule, in flight, run)
    arms = [(f"engine, {n} in flight" if n > 1 else "engine, one at a time", k, rule, n,
             lambda k=k, n=n, rule=rule: run_engine(k, rule, n))
            for n in flights for k, rule in [(0, 8)] + [(k, r) for k in ks for r in rules]]
    if not a.no_offline:
        arms += [("offline, one at a time", k, None, None, lambda k=k: run_offline(k)) for k in [0] + ks]
    for *_, fn in arms:  # compile (offline arms) and warm
        fn()
    on_share.clear()
    times: dict[int, list[float]] = {i: [] for i in range(len(arms))}
    outs, accs = {}, {}
    for _ in range(a.rounds):
        for i, (*_, fn) in enumerate(arms):
            t0 = time.perf_counter()
            outs[i], accs[i] = fn()
            times[i].append(time.perf_counter() - t0)
    ref = outs[0]
    rows = []
    for i, (setting, k, rule, n, _) in enumerate(arms):
        base = next(j for j, (s, kk, *_) in enumerate(arms) if s == setting and kk == 0)
        wall = statistics.median(times[i])
        share = on_share.get((k, rule, n))
        rows.append(dict(setting=setting, k=k, rule=rule if k else None,
                         tok_per_s=len(prompts) * a.tokens / wall, speedup=statistics.median(times[base]) / wall,
                         acceptance=None if accs[i] is None else accs[i][0] / accs[i][1],
                         spec_share=None if share is None else statistics.median(share),
                         identical=f"{sum(o == r for o, r in zip(outs[i], ref))}/{len(ref)}"))
    lines = ["| setting | draft k | spec_max_batch | output tokens/s | speed-up | acceptance rate | "
             "decode steps speculated | greedy tokens = target alone |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        share = "-" if r["spec_share"] is None else f"{r['spec_share']:.0%}"
        lines.append(f"| {r['setting']} | {r['k'] or 'none (target alone)'} | {r['rule'] or '-'} | "
                     f"{r['tok_per_s']:.0f} | {r['speedup']:.2f}x | {acc} | {share} | {r['identical']} |")
    note = (f"Target {a.target} (train loss {tloss:.2f}, lr {a.target_lr:g}), draft 1x64 (train loss {dloss:.2f}), "
            f"{a.steps} and {draft_steps} AdamW steps (batch 8 x 128 tokens); 8 prompts x {a.tokens} greedy tokens; medians of {a.rounds} alternating rounds; "
            f"{timing_note(load.record())}.")
    write_result(a.out, {"rows": rows, "note": note, "target": a.target}, "\n".join(lines) + f"\n\n{note}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
