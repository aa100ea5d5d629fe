"""The MoE experiment's figures and README (scripts/experiments/exp_moe.py writes the results dict):
validation loss of the headline arms, the router load across the load-balancing sweep, and the
claimed-vs-measured table with one load verdict per coefficient."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from scripts.experiments import expkit

REFERENCE = 0.01  # the first run's coefficient (issue 21), kept in the headline for reference


def headline_coefs(res: dict) -> list[float]:
    """The MoE arms of the headline: 0.01 (if swept) and the balancing coefficient, or, when none
    balances, the one whose busiest expert came closest."""
    sweep = res["sweep"].values()
    best = res["balancing_coef"]
    if best is None:
        best = min(sweep, key=lambda s: s["busiest"]["max"])["aux_coef"]
    return sorted({c for c in (REFERENCE, best) if any(s["aux_coef"] == c for s in sweep)})


def _arm(res: dict, coef: float) -> dict:
    return res["sweep"][f"{coef:g}"]


def figures(res: dict, out: Path) -> None:
    shown = headline_coefs(res)
    curves = {"dense": [(r["val_steps"], r["val_loss"]) for r in res["dense"]["runs"]]}
    curves |= {f"MoE, aux {c:g}": [(r["val_steps"], r["val_loss"]) for r in _arm(res, c)["runs"]] for c in shown}
    expkit.plot_runs(curves, out / "val_loss.png", xlabel="update", ylabel="validation loss",
                     title="char LM 4x64: dense vs MoE (8 experts, top-2), equal active parameters (mean, min-max)")
    sweep_figure(res, out / "router_load.png")
    layers_figure(res, shown, out / "router_load_layers.png")


def sweep_figure(res: dict, path: Path) -> None:
    """Per coefficient: the busiest and the least-used expert (share x E, worst layer) over
    training, mean over seeds with a min-max band; and the final shares sorted by rank."""
    plt = expkit.plt()
    crit = res["criterion"]
    fig, (top, low, bars) = plt.subplots(1, 3, figsize=(16, 4.4))
    arms = list(res["sweep"].values())
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        steps = arm["runs"][0]["val_steps"]
        load = np.asarray([r["load"] for r in arm["runs"]]) * res["config"]["experts"]  # (seeds, evals, L, E)
        color, label = f"C{i}", f"aux {arm['aux_coef']:g}"
        for ax, y in ((top, load.max((2, 3))), (low, load.min((2, 3)))):  # (seeds, evals): worst layer
            ax.plot(steps, y.mean(0), color=color, label=label)
            if len(y) > 1:
                ax.fill_between(steps, y.min(0), y.max(0), color=color, alpha=0.15)
        ranked = -np.sort(-load[:, -1], axis=-1)  # (seeds, L, E): each layer's shares, largest first
        rank = np.arange(ranked.shape[-1])
        bars.bar(rank + (i - (len(arms) - 1) / 2) * width, ranked.mean((0, 1)), width, color=color, label=label)
    top.axhline(crit["busiest_max"], color="k", ls="--", lw=0.8, label="criterion")
    low.axhline(crit["least_min"], color="k", ls="--", lw=0.8, label="criterion")
    for ax in (top, low, bars):
        ax.axhline(1, color="k", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
    seeds = len(arms[0]["runs"])
    top.set(title=f"busiest expert, worst layer ({seeds} seeds)", xlabel="update", ylabel="share x E (1 = fair share)")
    low.set(title=f"least-used expert, worst layer ({seeds} seeds)", xlabel="update", ylabel="share x E", ylim=(0, None))
    bars.set(title="final shares by rank (mean over layers and seeds)", xlabel="expert rank in its layer",
             ylabel="share x E")
    top.legend(fontsize=7)
    bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layers_figure(res: dict, coefs: list[float], path: Path) -> None:
    """Each layer's expert shares over training, seed 0, one row per coefficient in ``coefs``."""
    plt = expkit.plt()
    load0 = {c: np.asarray(_arm(res, c)["runs"][0]["load"]) for c in coefs}  # (evals, L, E)
    _, layers, experts = next(iter(load0.values())).shape
    fig, axes = plt.subplots(len(coefs), layers, figsize=(4 * layers, 3.2 * len(coefs)), squeeze=False)
    for row, c in enumerate(coefs):
        steps = _arm(res, c)["runs"][0]["val_steps"]
        for layer in range(layers):
            ax = axes[row, layer]
            for e in range(experts):
                ax.plot(steps, load0[c][:, layer, e], color=f"C{e}", label=f"expert {e}")
            ax.axhline(1 / experts, color="k", ls="--", lw=0.8)
            ax.set(title=f"aux {c:g}, layer {layer} (seed 0)", xlabel="update", ylabel="share of top-2 picks",
                   ylim=(0, None))
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(res: dict) -> str:
    """The command line that wrote these results (options left at their defaults omitted)."""
    from scripts.experiments import exp_moe

    C, smoke = res["config"], res["smoke"]
    flags = [("--smoke", smoke), (f"--steps {C['steps']}", not smoke and C["steps"] != 300),
             (f"--seeds {C['seeds']}", not smoke and C["seeds"] != 3),
             ("--aux-coefs " + ",".join(f"{c:g}" for c in C["aux_coefs"]), tuple(C["aux_coefs"]) != exp_moe.AUX_COEFS),
             ("--aux-per-layer", C.get("aux_per_layer")), (f"--z-coef {C['router_z_coef']:g}", C["router_z_coef"]),
             ("--grouped-steps 0", not smoke and res.get("grouped_ms_per_step") is None)]
    return " ".join(["python -m scripts.experiments.exp_moe"] + [f for f, on in flags if on])


def loss_name(C: dict) -> str:
    """The router losses of a run's config, in words."""
    return (("per-layer load-balancing loss" if C.get("aux_per_layer") else "load-balancing loss") + (f" with z-loss x {C['router_z_coef']:g}" if C["router_z_coef"] else ""))


def load_rows(res: dict) -> list[tuple]:
    """One claimed-vs-measured row per swept coefficient: does the router balance (the criterion)?"""
    crit, rows = res["criterion"], []
    for arm in res["sweep"].values():
        b, lo = arm["busiest"], arm["least"]
        fails = [f"busiest x{b['max']:.2f} > {crit['busiest_max']:g}" if b["max"] > crit["busiest_max"] else "",
                 f"least-used x{lo['min']:.2f} < {crit['least_min']:g}" if lo["min"] < crit["least_min"] else ""]
        rows.append(("issue 39", f"the {loss_name(res['config'])} at {arm['aux_coef']:g} keeps every expert in use: "
                     f"busiest <= {crit['busiest_max']:g}x, least-used >= {crit['least_min']:g}x fair share in every "
                     "layer and seed", f"final busiest expert x{b['max']:.2f} at worst (mean over seeds x{b['mean']:.2f});"
                     f" least-used x{lo['min']:.2f} at worst",
                     "holds" if arm["balanced"] else f"does not hold ({'; '.join(t for t in fails if t)})"))
    return rows


def _loss_row(dense: dict, moe: dict, coef: float, name: str = "load-balancing loss") -> list[str]:
    diff = dense["mean"] - moe["mean"]
    noise = (dense["std"] ** 2 + moe["std"] ** 2) ** 0.5
    verdict = (f"holds (by {diff:.3f}, seed spread ±{noise:.3f})" if diff > noise else
               f"does not hold (MoE worse by {-diff:.3f}, spread ±{noise:.3f})" if diff < -noise else
               f"not measurable here: the difference {diff:+.3f} is within the seed spread ±{noise:.3f}")
    return [f"MoE reaches a lower validation loss than a dense model with the same active parameters at equal "
            f"updates ({name} x {coef:g})", f"dense {expkit.pm(dense)}, MoE {expkit.pm(moe)}", verdict]


def markdown(res: dict, variants: list | None = None) -> str:
    C, P, crit, dense = res["config"], res["params"], res["criterion"], res["dense"]
    shown, best = headline_coefs(res), res["balancing_coef"]
    up = res.get("uptime", {})
    lines = ["# Mixture of Experts vs dense at equal active parameters (tinyshakespeare, characters)\n",
             f"`{command(res)}`: 4 layers x 64 wide, "
             f"{C['steps']} updates of 16 x 64 characters, {C['seeds']} seeds. Dense FFN: SwiGLU {C['dense_d_ff']}; "
             f"MoE FFN: {C['experts']} SwiGLU experts of {C['expert_d_ff']}, top-{C['top_k']} (Mixtral router), "
             f"load-balancing loss coefficient swept over {', '.join(f'{c:g}' for c in C['aux_coefs'])}, "
             + ("the loss taken per layer and averaged (`--aux-per-layer`: `moe.aux_loss_scope='layer'`)"
                if C.get("aux_per_layer") else
                "the loss over all layers pooled (`moe.aux_loss_scope='pooled'`, the default, as transformers')")
             + f"; router z-loss x {C['router_z_coef']:g}. Parameters: dense {P['dense']['total']:,}; MoE "
             f"{P['moe']['total']:,} in total, {P['moe']['active']:,} active per token. Validation loss on the "
             f"held-out 10% (4 batches); mean ± sample std over seeds. Timings {expkit.timing_note(res.get('load'))}"
             + (f"; `uptime` before: {up['before']}; after: {up['after']}" if up else "") + ".\n",
             f"**Router load** is each expert's share of its layer's top-2 picks on 2 fixed validation batches "
             f"(4,096 picks per layer), written as share x {C['experts']} (1 = its fair share; "
             f"{C['experts'] // C['top_k']} = all picks on {C['top_k']} experts). **Balance criterion** (fixed before "
             f"the runs): at the final evaluation, in every layer of every seed, the busiest expert <= "
             f"{crit['busiest_max']:g}x and the least-used >= {crit['least_min']:g}x its fair share. "
             + (f"**Balancing coefficient: {best:g}** (the smallest swept that meets it).\n" if best is not None else
                "**No swept coefficient meets it**; the headline uses the one closest"
                + "".join(f"; [{name}/]({name}/README.md) balances at {o['balancing_coef']:g} (below)"
                          for name, o in variants or [] if o["balancing_coef"] is not None) + ".\n"),
             "![validation loss](val_loss.png)\n", "![router load across the sweep](router_load.png)\n",
             "![per-layer router load, seed 0](router_load_layers.png)\n", "## Claimed vs measured\n"]
    rows = [("issue 21", *_loss_row(dense["final_val"], _arm(res, c)["final_val"], c, loss_name(C)))
            for c in reversed(shown)]
    ms_d, ms_m = dense["ms_per_step"]["mean"], _arm(res, shown[-1])["ms_per_step"]["mean"]
    rows.append(("issue 21", "MoE costs about the same time per update (equal active parameters)",
                 f"dense {ms_d:.1f} ms, MoE {ms_m:.1f} ms (dense all-experts einsum, x{ms_m / ms_d:.2f})"
                 + (f"; grouped ragged_dot {res['grouped_ms_per_step']:.1f} ms" if res.get("grouped_ms_per_step") else ""),
                 "does not hold on this CPU (every expert runs on every token in the dense implementation; ragged_dot "
                 "lowers to a masked dense product here)" if ms_m > 1.2 * ms_d else "holds (within the load noise)"))
    rows += load_rows(res)
    for _, other in variants or []:  # their balancing coefficient's loss row and their load rows
        if other["balancing_coef"] is not None:
            arm = _arm(other, other["balancing_coef"])
            rows.append(("issue 39", *_loss_row(other["dense"]["final_val"], arm["final_val"], arm["aux_coef"],
                                                loss_name(other["config"]))))
        rows += load_rows(other)
    lines.append(expkit.table(["claim", "measured", "verdict"], [r[1:] for r in rows]))
    res["claim_rows"] = [{"source": src, "claim": c, "measured": m, "verdict": v} for src, c, m, v in rows]
    lines.append("\n## The load-balancing sweep (MoE)\n")
    lines.append(sweep_table(res))
    lines.append(f"\nBusiest and least-used: share x E of the final evaluation, the worst layer of each seed. Aux loss: "
                 f"the load-balancing loss the run optimised (times its coefficient in the objective), mean of the "
                 f"last 10% of updates over seeds; {C['top_k']} (= top-k) is its minimum, reached when the load it "
                 f"measures is uniform.\n")
    head = "at the balancing coefficient" if best is not None else "at the coefficient closest to balance"
    lines.append(f"\n## Dense vs MoE {head} (headline), with 0.01 for reference\n")
    lines.append(headline_table(res, list(reversed(shown))))
    lines.append("\nThe same seed gives every arm the same batches, and every MoE arm the same initial weights. "
                 "Timings are secondary here (the machine was shared).\n")
    for name, other in variants or []:
        lines.append(f"\n## Variant: [{name}/]({name}/README.md)\n")
        lines.append(f"`{command(other)} --out results/moe/{name}`; balancing coefficient: "
                     + (f"{other['balancing_coef']:g}" if other["balancing_coef"] is not None else "none") + ".\n")
        lines.append(sweep_table(other))
        if other["balancing_coef"] is not None:
            lines.append(f"\nDense vs MoE at its balancing coefficient {other['balancing_coef']:g}:\n")
            lines.append(headline_table(other, [other["balancing_coef"]]))
    return "\n".join(lines) + "\n"


def headline_table(res: dict, coefs: list[float]) -> str:
    arms = [("dense", res["dense"])] + [(f"MoE, aux {c:g}", _arm(res, c)) for c in coefs]
    return expkit.table(["model", "final validation loss", "per seed", "ms/update", "compile s (seed 0)"],
                        [[k, expkit.pm(a["final_val"]), " ".join(f"{r['final_val']:.3f}" for r in a["runs"]),
                          expkit.pm(a["ms_per_step"], 1), f"{a['runs'][0]['compile_s']:.1f}"] for k, a in arms])


def sweep_table(res: dict) -> str:
    def aux_tail(arm):  # the last 10% of the updates, mean over seeds
        return float(np.mean([np.mean(r["aux"][-max(1, len(r["aux"]) // 10):]) for r in arm["runs"]]))

    return expkit.table(
        ["aux coef", "final validation loss", "busiest expert, worst seed and layer", "busiest, mean over seeds",
         "least-used, worst", "aux loss", "balanced"],
        [[f"{a['aux_coef']:g}", expkit.pm(a["final_val"]), f"x{a['busiest']['max']:.2f}", expkit.pm(a["busiest"], 2),
          f"x{a['least']['min']:.2f}", f"{aux_tail(a):.3f}", "yes" if a["balanced"] else "no"]
         for a in res["sweep"].values()])


def variants(out: Path) -> list[tuple[str, dict]]:
    """Sub-folders of ``out`` holding another exp_moe run (e.g. per_layer/ from --aux-per-layer)."""
    import json

    return [(p.parent.name, json.loads(p.read_text())) for p in sorted(out.glob("*/moe.json"))]


def main():
    """Rebuild a results folder's figures and README from its moe.json (no training)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out", type=Path, nargs="?", default=expkit.RESULTS / "moe", help="results folder (default results/moe)")
    args = p.parse_args()
    path = args.out / "moe.json"
    res = json.loads(path.read_text())
    figures(res, args.out)
    (args.out / "README.md").write_text(markdown(res, variants(args.out)))  # also refreshes res["claim_rows"]
    path.write_text(json.dumps(res, indent=1, default=expkit.json_default) + "\n")
    print(f"rebuilt {args.out}")


if __name__ == "__main__":
    main()
