"""The results of exp_shakespeare.py: the checks beside the runs (init std, dropout semantics), the
figures and the README (claimed vs measured), and what still differs from nanoGPT's train.py."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from scripts.experiments import expkit

NAME = "shakespeare"
NANOGPT_PUBLISHED = 1.88  # nanoGPT README, CPU config
NANOGPT_ISSUE = 1.874  # nanoGPT's train.py run in the issue
ISSUE_JAXGPT = (1.90, 1.92)


def _stats(rows, key):
    return expkit.stats([r[key] for r in rows])


def _f(x, d=3):
    return "n/a" if x is None else f"{x:.{d}f}"


def init_std_check() -> dict:
    """Seed 003 section 1.2: N(0, 0.02) everywhere, residual projections N(0, 0.02^2 / (2 n_layer))."""
    import jax

    from jaxgpt.config import get_preset
    from jaxgpt.models import init_params

    cfg = get_preset("gpt2-shakespeare-char").replace(vocab_size=65)
    p = init_params(cfg, jax.random.PRNGKey(0))
    L = p["layers"]
    return {"n_layer": cfg.n_layer, "expected_out": 0.02 / math.sqrt(2 * cfg.n_layer),
            "o_proj": float(np.std(L["attn"]["o_proj"]["kernel"])), "fc_out": float(np.std(L["mlp"]["fc_out"]["kernel"])),
            "q_proj": float(np.std(L["attn"]["q_proj"]["kernel"])), "tok_embed": float(np.std(p["tok_embed"]["embedding"]))}


def dropout_semantics() -> dict:
    """What `--set dropout=0.0` does to the attention dropout of the gpt2-shakespeare-char preset."""
    from jaxgpt.config import get_preset

    pre = get_preset("gpt2-shakespeare-char")
    cfg = pre.replace(dropout=0.0)
    eff = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout
    return {"preset_attn_dropout": pre.attn_dropout, "after_set_dropout_0": cfg.attn_dropout, "effective": eff,
            "follows_dropout": pre.attn_dropout is None}


def figures(res: dict, out: Path) -> list[str]:
    pyplot = expkit.plt()
    figs = []
    if "seed003" in res:
        fig, ax = pyplot.subplots(figsize=(7, 4))
        for i, fw in enumerate(("jaxgpt", "torch")):
            rs = [r for r in res["seed003"] if r["framework"] == fw]
            ys = np.stack([expkit.smooth(r["curve"], 10) for r in rs])
            x = np.arange(1, ys.shape[1] + 1)
            ax.plot(x, ys.mean(0), color=f"C{i}", label=f"{fw} (n={len(rs)}, 10-step mean)")
            ax.fill_between(x, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.2)
        ax.set(xlabel="step", ylabel="training loss", title="Seed 003's own run (2 x 100 steps, AdamW 3e-4, dropout 0.1)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "seed003_loss.png", dpi=110)
        pyplot.close(fig)
        figs.append("seed003_loss.png")
    if "nanogpt" in res:
        runs = res["nanogpt"]
        fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
        for i, fw in enumerate(("jaxgpt", "torch")):
            rs = [r for r in runs if r["framework"] == fw]
            curves = [expkit.curve(r["history"]) for r in rs]
            n = min(len(c[0]) for c in curves)
            x = np.asarray(curves[0][0][:n])
            ys = np.stack([expkit.smooth(c[1][:n], 10) for c in curves])
            lab = "jaxgpt" if fw == "jaxgpt" else "nanoGPT recipe (torch)"
            a1.plot(x, ys.mean(0), color=f"C{i}", label=f"{lab} train (n={len(rs)}, 100-step mean)")
            a1.fill_between(x, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.2)
            if fw == "jaxgpt":
                ev = [[(h["step"], h["val_loss"]) for h in r["history"] if "val_loss" in h] for r in rs]
            else:
                ev = [[(e["iter"], e["val"]) for e in r["evals"] if e["iter"] > 0] for r in rs]
            ex = [s for s, _ in ev[0]]
            ey = np.mean([[v for _, v in e] for e in ev], 0)
            a1.plot(ex, ey, "o--", color=f"C{i}", ms=4, label=f"{lab} val (own 20-batch eval, mean)")
            vf = [r["val_full"] for r in rs]
            a2.errorbar(np.full(len(vf), i) + np.linspace(-0.1, 0.1, len(vf)), vf,
                        yerr=[r["val_estimate_std"] for r in rs], fmt="o", color=f"C{i}", capsize=3)
            a2.plot([i - 0.2, i + 0.2], [np.mean(vf)] * 2, color=f"C{i}")
            a2.plot(np.full(len(rs), i + 0.3), [r["val_own"] for r in rs], "x", color=f"C{i}")
        a1.axhline(NANOGPT_PUBLISHED, color="gray", ls=":", label="nanoGPT README 1.88")
        a1.set(xlabel="iteration", ylabel="loss", title="nanoGPT CPU config (4x128, block 64, batch 12)", ylim=(1.5, 3.0))
        a1.grid(alpha=0.3)
        a1.legend(fontsize=7)
        a2.axhline(NANOGPT_PUBLISHED, color="gray", ls=":", label="nanoGPT README 1.88")
        a2.axhline(NANOGPT_ISSUE, color="k", ls="--", lw=0.8, label="issue: nanoGPT train.py 1.874")
        a2.axhspan(*ISSUE_JAXGPT, color="C3", alpha=0.1, label="issue: jaxgpt 1.90-1.92")
        a2.set_xticks([0, 1], ["jaxgpt", "nanoGPT\nrecipe (torch)"])
        a2.set(ylabel="validation loss at 2000", title="o: whole val split (bar: 20-batch estimate std)\nx: own 20-batch eval")
        a2.grid(alpha=0.3)
        a2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "nanogpt_cpu.png", dpi=110)
        pyplot.close(fig)
        figs.append("nanogpt_cpu.png")
    if "big" in res:
        b = res["big"]
        fig, ax = pyplot.subplots(figsize=(7, 4))
        x = [h["step"] for h in b["history"]]
        y = [h["loss"] for h in b["history"]]
        ax.plot(x, y, color="C0", alpha=0.4, label="training loss")
        ax.plot(x, expkit.smooth(y, 10), color="C0", label="10-step mean")
        ax.set(xlabel="iteration", ylabel="loss",
               title=f"gpt2-shakespeare-char (6x384, block 256, batch 64): {b['steps']} iterations")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "big_loss.png", dpi=110)
        pyplot.close(fig)
        figs.append("big_loss.png")
    return figs


def _thin(history: list[dict], every: int = 10) -> list[dict]:
    """Training-loss rows every ``every`` steps (and step 1) plus every evaluation row: jaxgpt's fit logs
    each step, the torch loop every 10th, so both curves are drawn from the same steps."""
    return [h for h in history if h["step"] % every == 0 or h["step"] == 1 or "loss" not in h]


def report(res: dict, out: Path, args, started: float):
    for r in res.get("nanogpt", []) + res.get("ablation", []):
        r["history"] = _thin(r["history"])
    sum_runs_s = sum(r.get("wall_s", 0.0) for k in ("seed003", "nanogpt", "ablation") for r in res.get(k, []))
    sum_runs_s += res.get("big", {}).get("wall_s", 0.0)
    res["runs_wall_s"] = sum_runs_s
    res["init_std"] = init_std_check()
    res["dropout_semantics"] = dropout_semantics()
    figs = figures(res, out)
    md = ["# Experiment 4: seed 003 / nanoGPT Shakespeare character model\n",
          "`.venv/bin/python -m scripts.experiments.exp_shakespeare` (default budget ~15 min on the quiet 2-core CPU; "
          "runs cached in `runs/`). Data: `../shared/data/tinyshakespeare.txt`, 65 characters, first 90% train "
          f"({res['data']['train_tokens']:,} tokens), last 10% validation ({res['data']['val_tokens']:,}).\n"]
    if args.smoke:
        md.append("**SMOKE RUN: tiny models and budgets, numbers meaningless.**\n")
    claims = []
    ini = res["init_std"]
    ok = abs(ini["o_proj"] - ini["expected_out"]) < 0.1 * ini["expected_out"] and abs(ini["fc_out"] - ini["expected_out"]) < 0.1 * ini["expected_out"]
    claims.append(["seed 003 §1.2: residual projections init N(0, 0.02²/(2·n_layer)), others N(0, 0.02²)",
                   f"std {ini['expected_out']:.5f} / 0.02",
                   f"o_proj {ini['o_proj']:.5f}, fc_out {ini['fc_out']:.5f}, q_proj {ini['q_proj']:.5f}, "
                   f"tok_embed {ini['tok_embed']:.5f}", "holds" if ok else "does not hold"])

    if "seed003" in res:
        md.append("## 1. Seed 003's own run\n")
        md.append("128 wide, 4 layers, 4 heads, block 32, batch 16, dropout 0.1 (embedding, attention, residual), "
                  "tied head, torch's default AdamW (lr 3e-4 constant, betas (0.9, 0.999), weight decay 0.01 on "
                  "every parameter), clip 1.0, 2 x 100 steps. *Train* = mean training loss of the epoch's 100 steps, "
                  "*val (1 batch)* = the seed's one random 16 x 32 validation batch, *val (all)* = the whole "
                  "validation split after training. jaxgpt: `TrainConfig(schedule='constant', beta2=0.999, "
                  "weight_decay=0.01, decay='all')`; torch: the seed's loop on torch_ref's model.\n")
        rows = []
        for r in res["seed003"]:
            e1, e2 = r["epochs"]
            rows.append([r["framework"], r["seed"], _f(e1["train_loss"]), _f(e1["val_loss_1batch"]), _f(e2["train_loss"]),
                         _f(e2["val_loss_1batch"]), _f(r["val_full"]), _f(r["ms_per_step"], 0)])
        md.append(expkit.table(["framework", "seed", "epoch 1 train", "epoch 1 val (1 batch)", "epoch 2 train",
                                "epoch 2 val (1 batch)", "val (all)", "ms/step (under load)"], rows))
        md.append("\n![seed 003 loss](seed003_loss.png)\n\nSamples (\"To be or not\", T 0.8, top-k 40, 100 characters, seed 0):\n")
        for r in res["seed003"]:
            if r["seed"] == 0:
                md.append(f"*{r['framework']}*:\n```\n{r['sample']}\n```\n")
        jx = [r for r in res["seed003"] if r["framework"] == "jaxgpt"]
        fell = all(r["epochs"][1]["train_loss"] < r["epochs"][0]["train_loss"] for r in res["seed003"])
        claims.append(["seed 003 §9: the 2 x 100-step run trains and samples from \"To be or not\" (no numbers claimed)",
                       "loss falls, text comes out",
                       f"jaxgpt epoch-2 train {expkit.pm(expkit.stats([r['epochs'][1]['train_loss'] for r in jx]))}, "
                       f"val (all) {expkit.pm(_stats(jx, 'val_full'))}; samples are character soup with spaces "
                       "(200 steps is far from words)", "holds" if fell else "does not hold"])

    if "nanogpt" in res:
        runs = res["nanogpt"]
        jx = [r for r in runs if r["framework"] == "jaxgpt"]
        tr = [r for r in runs if r["framework"] == "torch"]
        sj, st = _stats(jx, "val_full"), _stats(tr, "val_full")
        oj, ot = _stats(jx, "val_own"), _stats(tr, "val_own")
        gap = sj["mean"] - st["mean"]
        se = math.sqrt(sj["std"] ** 2 / sj["n"] + st["std"] ** 2 / st["n"]) if sj["n"] and st["n"] else float("nan")
        est_std = expkit.stats([r["val_estimate_std"] for r in runs])
        res["nanogpt_summary"] = {"jaxgpt_val_full": sj, "torch_val_full": st, "jaxgpt_val_own": oj, "torch_val_own": ot,
                                  "gap_val_full": gap, "gap_se": se, "estimator_std": est_std,
                                  "jaxgpt_train_sample": _stats(jx, "train_sample"),
                                  "torch_train_sample": _stats(tr, "train_sample"),
                                  "jaxgpt_ms_per_step": _stats(jx, "ms_per_step"), "torch_ms_per_step": _stats(tr, "ms_per_step")}
        md.append("## 2. nanoGPT's CPU config\n")
        md.append("nanoGPT README: `python train.py config/train_shakespeare_char.py --device=cpu --compile=False "
                  "--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 "
                  "--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0` -> val loss ~1.88. "
                  "Both sides: 4 layers, 128 wide, 4 heads, block 64, batch 12, no biases, tied head, exact GELU, "
                  "lr 1e-3, warmup 100, cosine to 1e-4 at 2000, betas (0.9, 0.99), weight decay 0.1, clip 1.0, "
                  "float32, dropout 0 (attention dropout too).\n\n"
                  "* **jaxgpt**: the `gpt2-shakespeare-char` preset resized, `dropout=attn_dropout=0.0`, biases off "
                  "(nanoGPT's train.py default `bias=False`; the GPT-2 preset has biases), `TrainConfig(steps=2000, "
                  "batch_size=12, seq_len=64, lr=1e-3, warmup_steps=100, min_lr_ratio=0.1, beta2=0.99, decay='matrices')`, "
                  "`expkit.train`; its own eval = 20 fixed windows x 12 (`eval_batches=20`).\n"
                  "* **nanoGPT recipe (torch)**: `scripts/experiments/nanogpt_torch.py`, torch_ref's model with nanoGPT's param "
                  "groups, `get_lr`, `get_batch` and `estimate_loss` (20 fresh random batches per split).\n"
                  "* **val (all)**: every final model scored on the whole validation split (1742 non-overlapping "
                  "64-token windows, 111,488 tokens), the same windows for both. **20-batch est. std**: the standard "
                  "deviation of nanoGPT's `estimate_loss` value for a fixed model, from 10 redraws.\n")
        rows = []
        for r in runs:
            rows.append(["jaxgpt" if r["framework"] == "jaxgpt" else "nanoGPT recipe (torch)", r["seed"],
                         _f(r["val_own"]), _f(r["val_full"]), _f(r["val_estimate_std"]), _f(r["train_sample"]),
                         _f(r["ms_per_step"], 0)])
        md.append(expkit.table(["side", "seed", "val (own eval)", "val (all)", "20-batch est. std", "train (2400 windows)",
                                "ms/step (under load)"], rows))
        md.append("\n" + expkit.table(["", "jaxgpt", "nanoGPT recipe (torch)"], [
            ["val (all), mean ± std", expkit.pm(sj), expkit.pm(st)],
            ["val (own eval), mean ± std", expkit.pm(oj), expkit.pm(ot)],
            ["train (sample), mean ± std", expkit.pm(_stats(jx, "train_sample")), expkit.pm(_stats(tr, "train_sample"))],
            ["ms per step (measured under load)", expkit.pm(_stats(jx, "ms_per_step"), 0),
             expkit.pm(_stats(tr, "ms_per_step"), 0)]]))
        md.append(f"\njaxgpt - torch on val (all): **{gap:+.3f} ± {se:.3f}** (difference of means ± its standard error). "
                  f"nanoGPT's 20-batch estimate itself has std {est_std['mean']:.3f} for a fixed model.\n")
        z = (st["mean"] - NANOGPT_ISSUE) / math.sqrt(st["std"] ** 2 + est_std["mean"] ** 2) if st["n"] > 1 else float("nan")
        md.append(f"\n**Reading.** Every number nanoGPT prints is one seed's 20-batch estimate: its spread for a fixed "
                  f"model is {est_std['mean']:.3f} and the seed-to-seed spread of the whole-split loss is "
                  f"{st['std']:.3f} (torch) / {sj['std']:.3f} (jaxgpt). The nanoGPT recipe mirrored in torch averages "
                  f"{st['mean']:.3f} on the whole split (own 20-batch evals {ot['min']:.3f}-{ot['max']:.3f}); the issue's "
                  f"1.874 from nanoGPT's train.py is {z:.1f} combined standard deviations from that mean, the README's "
                  f"1.88 is a rounded single run. jaxgpt averages {sj['mean']:.3f}, {gap:+.3f} ± {se:.3f} from the "
                  f"torch recipe, with nanoGPT's weight-decay grouping (`decay='matrices'`: Linear kernels and embeddings). "
                  f"Before that option existed jaxgpt ran with `decay='all'` (LayerNorm gains decayed too) and measured "
                  f"1.924 ± 0.007 (n=3); `--parts ablation` runs the torch recipe with `decay='all'` groups to "
                  f"measure that effect (not in the default budget: 3 more 2000-step runs).\n")
        if res.get("ablation"):
            sa = _stats(res["ablation"], "val_full")
            res["nanogpt_summary"]["torch_decay_all_val_full"] = sa
            md.append(f"\nAblation: the nanoGPT recipe with `decay='all'` groups (LayerNorm gains decayed too): "
                      f"val (all) {expkit.pm(sa)} against {expkit.pm(st)} with nanoGPT's groups.\n")
        md.append("\n![nanoGPT CPU config](nanogpt_cpu.png)\n")
        md.append("\nSamples (prompt \"\\n\", T 0.8, top-k 200 as nanoGPT's sample.py, 300 characters, seed 0):\n")
        for r in runs:
            if r["seed"] == 0:
                md.append(f"*{r['framework']}*:\n```\n{r['sample']}\n```\n")
        md.append(DIFFERENCES)
        tol = 0.03
        claims.append(["nanoGPT README: CPU config reaches val loss ~1.88 (jaxgpt)", "~1.88 (± 0.03 stated beforehand)",
                       f"val (all) {expkit.pm(sj)}; own eval {expkit.pm(oj)}",
                       "holds" if abs(sj["mean"] - NANOGPT_PUBLISHED) <= tol else f"does not hold (measured {sj['mean']:.3f})"])
        claims.append(["same, nanoGPT's recipe (torch mirror)", "~1.88 (issue: 1.874 with nanoGPT's train.py)",
                       f"val (all) {expkit.pm(st)}; own 20-batch eval {expkit.pm(ot)}",
                       "holds" if abs(st["mean"] - NANOGPT_PUBLISHED) <= tol else f"does not hold (measured {st['mean']:.3f})"])
        within = abs(gap) <= max(2 * se, 0.01)
        claims.append(["issue: jaxgpt (all dropout off) is behind nanoGPT, 1.90-1.92 vs 1.874",
                       "gap ~0.03-0.05", f"gap on the whole val split {gap:+.3f} ± {se:.3f} (n={sj['n']}+{st['n']})",
                       "does not hold any more: no gap beyond noise, the difference is within 2 standard errors" if within
                       else f"gap remains (measured {gap:+.3f} ± {se:.3f})"])
    ds = res["dropout_semantics"]
    claims.append(["issue: `--set dropout=0.0` turns off nanoGPT's one dropout",
                   "attention dropout follows `dropout`",
                   f"preset attn_dropout={ds['preset_attn_dropout']}; after dropout=0.0: effective attention dropout "
                   f"{ds['effective']}",
                   "holds (attn_dropout=None follows dropout)" if ds["follows_dropout"]
                   else f"does not hold yet (attention dropout stays {ds['effective']}; set attn_dropout=0.0 too)"])
    if "big" in res:
        b = res["big"]
        md.append("## 3. The 6-layer 384-wide config\n")
        md.append("`gpt2-shakespeare-char` preset (6 layers, 384 wide, 6 heads, block 256, dropout 0.2 everywhere, GPT-2 "
                  "biases), batch 64, nanoGPT's `train_shakespeare_char.py` optimiser: lr 1e-3, warmup 100, cosine "
                  "to 1e-4 over 5000 iterations, beta2 0.99, weight decay 0.1, clip 1.0. Trained for "
                  + (f"{b['train_s']:.0f} s after {b['compile_s']:.0f} s compiling (the `--big-seconds` budget): "
                     if "compile_s" in b else f"{b['train_s']:.0f} s (compile + the `--big-seconds` budget): ")
                  + f"**{b['steps']} iterations** "
                  f"({b['s_per_step_after_first']:.2f} s/iteration after the first, "
                  f"{b.get('timing', 'measured under load')})"
                  f"{', still in the warmup' if b['steps'] <= 100 else ''}. "
                  f"Last training loss {b['history'][-1]['loss']:.3f}; validation loss on 32 random "
                  f"256-token windows {b['val_sample_loss']:.3f}.\n\n![6x384 loss](big_loss.png)\n\n"
                  f"Sample (\"\\n\", T 0.8, top-k 200):\n```\n{b['sample']}\n```\n")
        claims.append(["nanoGPT README: 6x384 config reaches val ~1.47 after 5000 iterations (~3 min on an A100)", "1.47",
                       f"{b['steps']} iterations in {b['train_s']:.0f} s: loss {b['history'][-1]['loss']:.3f}",
                       "not measurable here (5000 iterations of 64x256 tokens need hours on the 2-core CPU)"])
    md.insert(2, "## Claimed vs measured\n\n" + expkit.table(["claim", "claimed", "measured", "verdict"], claims) +
              f"\nThe runs took {sum_runs_s / 60:.0f} min of wall time in all (sum over `runs/*.json`). "
              "The seed 003 and nanoGPT runs were timed under load (five jobs sharing the 2 cores); torch ran with 1 thread and XLA "
              "with one Eigen thread (oversubscribed threads were 7x slower).\n")
    res["claims"] = claims
    res["figures"] = figs
    expkit.write_results(out, NAME, res, "\n".join(md), smoke=args.smoke, started=started)


DIFFERENCES = """
### What still differs between jaxgpt and nanoGPT's train.py

| | nanoGPT train.py | jaxgpt here | effect |
|---|---|---|---|
| weight decay | on every >=2-D param: Linear weights **and both embeddings** (the token one is the tied head); not on LayerNorm weights | `decay='matrices'` here: Linear kernels and both embeddings, as nanoGPT (`'all'`, the seeds' default, also decays LayerNorm gains: about +0.012 val loss, see the ablation) | none with `'matrices'` |
| warmup | `lr * (it + 1) / (warmup + 1)` | `lr * (step + 1) / warmup` | < 1% lr difference, first 100 steps only |
| init | N(0, 0.02), c_proj N(0, 0.02/sqrt(2L)), fused `c_attn` | same distributions, separate q/k/v, JAX's PRNG | different random numbers only |
| biases | train.py default `bias=False` (LayerNorm too) | the gpt2 preset has biases; set off here | none once set |
| dropout | one `dropout` for embedding, attention and residual | `dropout` + `attn_dropout` (preset 0.2) | 0.04-0.06 when attn_dropout stays 0.2 (the issue's first finding) |
| batches | `torch.randint(N - T)` starts, global torch RNG | `default_rng([seed, step]).integers(0, N - T)` | same distribution |
| evaluation | 20 fresh random batches of 12 x 64 per eval (15,360 tokens) | `eval_batches` fixed windows of 12 x 64 chosen by the seed | both are noisy estimates of the same number (std measured above) |
| updates | loop makes max_iters + 1 = 2001 updates; the reported loss is after 2000 | 2000 | none |
"""

