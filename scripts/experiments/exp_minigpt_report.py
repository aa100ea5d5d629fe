"""Claims (claimed vs measured) and the README of exp_minigpt.py."""
from __future__ import annotations

from scripts.experiments import expkit

NOPOS, POSTLN, RELU = "no position encoding", "Post-LN", "ReLU FFN"
SCALED, SCALED_NOPOS = "embed x sqrt(d), sinusoidal", "embed x sqrt(d), no position"


def _f(s: dict) -> str:
    return expkit.pm(s, 3)


def _apart(a: dict, b: dict) -> bool:
    """The per-seed ranges do not overlap."""
    return a["max"] < b["min"] or b["max"] < a["min"]


def claims(res: dict, base: str) -> list[dict]:
    runs, steps = res["runs"], res["steps"]
    fin = {k: v["final_loss"] for k, v in runs.items()}
    rows = []
    b = runs[base]
    cross = b["step_below_1.5"]
    ok = all(c is not None for c in cross)
    rows.append({"claim": "training loss falls from ~3.5 to < 1.5 within ~500 steps", "source": "seed 000",
                 "measured": f"initial {_f(b['initial_loss'])}; first step < 1.5 per seed: {cross} "
                             f"(20-step average: {b['step_below_1.5_smoothed']}); final {_f(fin[base])} at step {steps} "
                             f"(first {steps} steps of the seed's 15-epoch schedule; with the cosine compressed into "
                             f"{steps} steps, seed 0: first < 1.5 at {res['compressed_schedule']['step_below_1.5']}, "
                             f"final {res['compressed_schedule']['final_loss']:.3f})",
                 "verdict": "holds" if ok else f"does not hold (not below 1.5 within {steps} steps for every seed)"})
    n, p = fin[NOPOS], fin[base]
    holds = n["min"] > p["max"]
    rows.append({"claim": "without position encoding the loss is clearly higher than with it", "source": "seed 000",
                 "measured": f"final loss no-PE {_f(n)} vs sinusoidal {_f(p)}",
                 "verdict": "holds" if holds else f"does not hold (measured no-PE {n['mean']:.3f} vs PE {p['mean']:.3f})"})
    r = fin[RELU]
    rows.append({"claim": "SwiGLU is usually slightly better than ReLU", "source": "seed 000",
                 "measured": f"final loss SwiGLU {_f(p)} vs ReLU {_f(r)}",
                 "verdict": ("holds" if p["mean"] < r["mean"] else
                             f"does not hold (measured SwiGLU {p['mean']:.3f} vs ReLU {r['mean']:.3f})")
                 + ("" if _apart(p, r) else "; the per-seed ranges overlap")})
    q = fin[POSTLN]
    rows.append({"claim": "Pre-LN vs Post-LN: the ablation shows a difference", "source": "seed 000 (conclusions)",
                 "measured": f"final loss Pre-LN {_f(p)} vs Post-LN {_f(q)}",
                 "verdict": "holds" if _apart(p, q) else "does not hold (the per-seed ranges overlap)"})
    s, sn = fin[SCALED], fin[SCALED_NOPOS]
    supported = s["max"] < sn["min"]
    rows.append({"claim": "explanation: unit sinusoids swamp 0.02-scale embeddings; with embeddings x sqrt(d_model) "
                          "positions should help", "source": "issue #12",
                 "measured": f"with x sqrt(d): PE {_f(s)} vs no-PE {_f(sn)}; unscaled: PE {_f(p)} vs no-PE {_f(n)}",
                 "verdict": "holds" if supported else "does not hold (with scaled embeddings PE is still not "
                                                      f"clearly better: {s['mean']:.3f} vs {sn['mean']:.3f})"})
    e = res["epochs"]
    rows.append({"claim": "the seed's full run: 15 epochs", "source": "seed 000",
                 "measured": f"first {e['steps']} of {15 * e['steps_per_epoch']} steps ({e['epochs']:.2g} epochs), "
                             f"final loss {e['final_loss']:.3f}",
                 "verdict": "holds (ran)" if e["epochs"] >= 15 else
                 f"not measurable here (budget: ran {e['epochs']:.2g} of the 15 epochs; --epochs 15 runs them)"})
    kv = res["kv_cache"]["rows"]
    sp = [round(k["speedup_vs_growing_prefix"], 2) for k in kv]
    rows.append({"claim": "KV-cache decoding is faster than without a cache", "source": "seed 000",
                 "measured": f"speed-up vs growing prefix at {[k['new_tokens'] for k in kv]} new tokens: {sp}",
                 "verdict": "holds" if min(sp) > 1 else f"does not hold (measured speed-ups {sp})"})
    grows = sp[-1] > sp[0]
    rows.append({"claim": "the longer the sequence, the larger the speed-up", "source": "seed 000",
                 "measured": f"{sp[0]}x at {kv[0]['new_tokens']} -> {sp[-1]}x at {kv[-1]['new_tokens']} tokens",
                 "verdict": "holds" if grows else f"does not hold (measured {sp})"})
    same = res["kv_cache"]["all_identical"]
    rows.append({"claim": "cached and uncached decoding give identical outputs", "source": "seed 000",
                 "measured": f"greedy token equality at every length: {same}; sampled (T=1, same rng): "
                             f"{res['kv_cache']['sampled_T1_cache_equals_no_cache']}",
                 "verdict": "holds" if same else "does not hold"})
    smp = res["samples"]["abcde"]
    r0, r2 = smp[0]["in_corpus_trigrams"], smp[-1]["in_corpus_trigrams"]
    rows.append({"claim": "T=2.0 gives high diversity but possibly garbled text (T=0 deterministic)", "source": "seed 000",
                 "measured": f"in-corpus trigram share of 'abcde' samples: T=0 {r0:.2f}, T=2 {r2:.2f}",
                 "verdict": "holds" if r2 < r0 else f"does not hold (measured {r0:.2f} vs {r2:.2f})"})
    hm = res["heatmaps"]
    rows.append({"claim": "attention heatmaps show the causal lower-triangular pattern", "source": "seed 000",
                 "measured": f"largest weight above the diagonal: {hm['max_weight_above_diagonal']:.1e}",
                 "verdict": "holds" if hm["max_weight_above_diagonal"] < 1e-6 else "does not hold"})
    c = res["cross_framework"]
    rows.append({"claim": f"jaxgpt and torch_ref give the same run (final loss within {c['tolerance']})",
                 "source": "issue #12 (exp. 6)",
                 "measured": f"final {c['final_loss_jax']:.4f} vs {c['final_loss_torch']:.4f} "
                             f"(abs. difference {c['final_abs_diff']:.1e}; max per-step diff over the first 20 steps "
                             f"{c['max_abs_diff_first_20_steps']:.1e})",
                 "verdict": "holds" if c["within_tolerance"] else f"does not hold (abs. difference {c['final_abs_diff']:.3g})"})
    return rows


def markdown(res: dict, rows: list[dict], base: str, args) -> str:
    runs, steps, e, c, kv = res["runs"], res["steps"], res["epochs"], res["cross_framework"], res["kv_cache"]
    md = [f"# Experiment 2: seed 000 MiniGPT{' (SMOKE: not results)' if res['smoke'] else ''}\n",
          f"`.venv/bin/python -m scripts.experiments.exp_minigpt` (seeds {res['seeds']}, {steps} steps per run, "
          f"{e['epochs']:.2g} epochs for the long run). Corpus `seed-synthetic` (seed 000's text, "
          f"val_fraction {e['val_fraction']}: the seed trains on all of it), presets "
          "`seed-minigpt[-nopos|-postln|-relu]`, the seed's optimizer and schedule: every run is the beginning of "
          "the seed's 15-epoch run (`TrainConfig(epochs=15)` + `with_epochs`: AdamW 3e-4, cosine to 0.1x over "
          f"15 x {e['steps_per_epoch']} steps), so over the first {steps} steps the learning rate stays near 3e-4 "
          "as in the seed. Loss = training loss; \"final\" = mean of the last 20 steps; "
          f"mean ± std over seeds. Timings: {res['note']}.\n",
          "## Claimed vs measured\n",
          expkit.table(["claim", "source", "measured", "verdict"],
                       [[str(r[k]).replace("|", "/") for k in ("claim", "source", "measured", "verdict")] for r in rows]),
          f"\n## Ablations ({steps} steps each)\n\n![ablations](ablations.png)\n![embed_scale](embed_scale.png)\n",
          expkit.table(["config", "initial loss", f"final loss (step {steps})", "first step < 1.5, per seed",
                        "ms/step"],
                       [[k, _f(v["initial_loss"]), _f(v["final_loss"]), v["step_below_1.5"],
                         f"{v['ms_per_step']['mean']:.0f}"] for k, v in runs.items()]),
          "\nThe embed x sqrt(d_model) rows test the issue's explanation of the no-position result "
          "(token embeddings of std 0.02 next to unit-amplitude sinusoids); with the scaling the token "
          "embeddings have std 0.16, still below the sinusoids' amplitude. For reference, the issue's run of the "
          "seed's own PyTorch code (500 steps) gave: loss < 1.5 at step 252, final 0.576 with positions and 0.105 "
          "without. A possible reason why positions do not help here (not tested): the training windows start at "
          "random offsets of a largely periodic text, so the absolute position inside a window says nothing about "
          "the next character, while the causal mask already lets a model without positions infer order.\n",
          f"\n## Long run: the first {e['epochs']:.2g} epochs of the seed's 15 ({e['steps']} steps, "
          f"{e['steps_per_epoch']} per epoch; seed 0 baseline)\n",
          f"![epochs](epochs.png)\n\nMean loss per epoch: {[round(x, 4) for x in e['epoch_mean_loss']]}; "
          f"final {e['final_loss']:.4f}; {e['ms_per_step']:.0f} ms/step. The seed runs 15 epochs "
          f"({15 * e['steps_per_epoch']} steps); {'' if e['epochs'] >= 15 else 'they do not fit the default budget: '}"
          f"`--epochs 15` runs them. The figure also shows `TrainConfig(steps={steps})` (seed 0, the cosine "
          f"compressed into {steps} steps): final loss {res['compressed_schedule']['final_loss']:.3f}.\n",
          "\n## Cross-framework (seed 0, baseline): jaxgpt vs torch_ref\n\n![cross](cross_framework.png)\n",
          expkit.table(["", "jaxgpt", "torch_ref"],
                       [["final loss (last 20 steps)", f"{c['final_loss_jax']:.5f}", f"{c['final_loss_torch']:.5f}"],
                        ["ms/step", f"{c['ms_per_step_jax']:.1f}", f"{c['ms_per_step_torch']:.1f}"]]),
          f"\nSame initial weights (jaxgpt's init converted with `torch_ref.convert.load_params`), same batches "
          f"(`task.batch`), torch {c['torch_version']} with {c['torch_threads']} threads in its own process. "
          f"Absolute final difference {c['final_abs_diff']:.2e} (tolerance {c['tolerance']}); largest per-step "
          f"difference {c['max_abs_diff_all_steps']:.2e} (first 20 steps: {c['max_abs_diff_first_20_steps']:.2e}).\n",
          f"\n## KV cache (greedy, prompt of {kv['prompt_tokens']} tokens, median of 3)\n\n![kv](kv_cache.png)\n",
          expkit.table(["new tokens", "KV cache ms", "growing prefix ms", "fixed window ms", "speed-up vs prefix",
                        "identical tokens"],
                       [[r["new_tokens"], f"{r['kv_cache_ms']:.1f}", f"{r['growing_prefix_ms']:.1f}",
                         f"{r['fixed_window_ms']:.1f}", f"{r['speedup_vs_growing_prefix']:.1f}x", r["identical"]]
                        for r in kv["rows"]]),
          "\nKV cache: `jaxgpt.inference.generate` (one compiled prefill + while_loop). Growing prefix: the seed's "
          "baseline, a Python loop with one jitted forward of the whole prefix per token (padded to a "
          "multiple of 16 positions so that 16 shapes compile). Fixed window: `generate(use_cache=False)`.\n",
          "\n## Samples (model of the long run, rng PRNGKey(0))\n",
          expkit.table(["prompt", "T", "text", "in-corpus trigrams"],
                       [[p, s["temperature"], "`" + s["text"].replace("|", "/") + "`", f"{s['in_corpus_trigrams']:.2f}"]
                        for p, ss in res["samples"].items() for s in ss]),
          f"\n## Attention heatmaps (long-run model, text `{res['heatmaps']['text']}`)\n\n![attention](attention.png)\n\n"
          f"Mean weight on the token 7 back (the period of `abcdefg`) per layer x head: "
          f"{res['heatmaps']['mean_weight_7_back']}; on the previous token: {res['heatmaps']['mean_weight_on_previous']}.\n",
          f"\nWall time of the parts (s): {res['timings_s']}.\n"]
    return "\n".join(md)
