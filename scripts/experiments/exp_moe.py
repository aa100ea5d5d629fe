"""Experiment: Mixture of Experts vs a dense model at equal active parameters (issues 21, 39).

A character LM on tinyshakespeare (expkit.shakespeare(), char tokenizer, 90/10 split, held-out
validation loss): 4 layers x 64 wide, RoPE, RMSNorm, SwiGLU. The dense model's FFN is one SwiGLU
of width 128; the MoE model's FFN is 8 SwiGLU experts of width 64 with top-2 routing (Mixtral's
router: softmax, top-2, renormalised), so each token runs 2 x 64 = 128 FFN units in both: equal
active parameters (the MoE adds a 64 x 8 router per layer and holds 4x the FFN parameters in
total). Same optimiser for both (AdamW 2e-3, warmup, cosine, clip 1.0, batches of 16 x 64),
identical data order per seed, seeds 0, 1, 2.

The MoE runs sweep the router's load-balancing loss coefficient (TrainConfig.router_aux_coef,
--aux-coefs; z-loss --z-coef, default off), every seed at every coefficient. The router load is
the share of the top-2 picks each expert receives on 2 fixed validation batches, per layer, at
every evaluation. Balance criterion, fixed before the runs: at the final evaluation, in every layer
and every seed, the busiest expert takes at most 1.5x its fair share (1/8) and the least-used at
least 0.5x. The balancing coefficient is the smallest swept that meets it (none: the one whose
busiest expert came closest); the headline compares dense with MoE at that coefficient and at 0.01,
the first run's. Report and figures: exp_moe_report, which also summarises runs written to
sub-folders of --out (results/moe/per_layer, results/moe/zloss) and rebuilds a folder from its JSON.

Also measured: ms per update (the jitted step, compile apart; moe.impl='dense', every expert on
every token, the fast choice on a CPU; the grouped ragged_dot implementation is timed on a few
extra updates).

    .venv/bin/python -m scripts.experiments.exp_moe [--smoke] [--out DIR] [--seeds N] [--steps N]
        [--aux-coefs 0.01,0.1,1] [--z-coef Z]
"""
from __future__ import annotations

import subprocess
import time

from scripts.experiments import expkit
from scripts.harness import step_times

NAME = "moe"
EXPERTS, TOP_K, DENSE_FF, EXPERT_FF = 8, 2, 128, 64
AUX_COEFS = (0.01, 0.1, 1.0, 3.0, 10.0, 30.0, 100.0)  # the default sweep (chosen by a 1-seed scout: 10 nearly balances)
BALANCE_MAX, BALANCE_MIN = 1.5, 0.5  # the criterion: busiest <= 1.5x fair share, least-used >= 0.5x


def model_config(kind: str, vocab: int, seq_len: int, layers: int = 4, width: int = 64, impl: str = "dense",
                 aux_scope: str = "pooled"):
    from jaxgpt.config import ModelConfig, MoEConfig

    cfg = ModelConfig(vocab_size=vocab, d_model=width, n_layer=layers, n_head=4, d_ff=DENSE_FF, max_len=seq_len,
                      pos="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu")
    if kind == "moe":
        cfg = cfg.replace(moe=MoEConfig(n_experts=EXPERTS, top_k=TOP_K, d_ff=EXPERT_FF, impl=impl,
                                        aux_loss_scope=aux_scope))
    return cfg


def train_config(steps: int, seed: int, eval_every: int, aux_coef: float = 0.01, z_coef: float = 0.0):
    from jaxgpt.config import TrainConfig

    return TrainConfig(steps=steps, batch_size=16, seq_len=64, lr=2e-3, warmup_steps=min(20, steps // 5),
                       min_lr_ratio=0.1, weight_decay=0.1, decay="linear", grad_clip=1.0, val_fraction=0.1,
                       eval_every=eval_every, eval_batches=4, seed=seed, router_aux_coef=aux_coef,
                       router_z_coef=z_coef)


def active_params(config, params) -> dict:
    """Total parameters, and those one token uses (the MoE's top-k experts of n_experts)."""
    import jax
    import numpy as np

    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if config.moe is None:
        return {"total": total, "active": total}
    experts = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params["layers"]["mlp"]["experts"]))
    return {"total": total, "active": total - experts + experts * config.moe.top_k // config.moe.n_experts}


def load_probe(config, batches):
    """-> f(params): (layers, experts) share of the top-k picks per expert on ``batches``."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.models import build

    xs = jnp.concatenate([jnp.asarray(b["x"]) for b in batches])

    @jax.jit
    def f(params):
        _, state = build(config).apply({"params": params}, xs, mutable=["router"])
        counts = state["router"]["layers"]["mlp"]["stats"][0]["counts"]  # (L, E)
        return counts / counts.sum(-1, keepdims=True)

    return f


def train_run(config, tc, task, params, cache: dict, probe=None) -> dict:
    from jaxgpt.train import make_eval_step, make_train_steps

    tc = tc.replace(log_every=tc.eval_every)
    key = (config, tc.replace(seed=0))
    if key not in cache:
        cache[key] = (make_train_steps(config, tc, tc.updates_per_call), make_eval_step(config))
    train_steps, eval_step = cache[key]
    on_eval = None if probe is None else (lambda step, p: {"load": probe(p).tolist()})
    r = expkit.train(config, tc, task, params=params, train_steps=train_steps, eval_step=eval_step, on_eval=on_eval)
    val = [h for h in r["history"] if "val_loss" in h]
    return r | {"val_steps": [h["step"] for h in val], "val_loss": [h["val_loss"] for h in val],
                "load": [h["load"] for h in val if "load" in h],
                "aux": [h["router_aux"] for h in r["history"] if "router_aux" in h]}


def time_steps(config, tc, task, params, n: int) -> float:
    """ms per update of ``n`` jitted updates after one compiling update (no evaluation)."""
    import jax

    from jaxgpt.train import init_state, make_train_step

    step = make_train_step(config, tc)
    state = init_state(config, tc, params=params)
    batches = [task.batch(tc, s) for s in range(n + 1)]
    return step_times(step, state, batches, sync=jax.block_until_ready, overlap=True)[2][0] * 1e3


def parse_coefs(text: str) -> list[float]:
    """'0.01,0.1,1' -> [0.01, 0.1, 1.0]: distinct coefficients >= 0, in increasing order."""
    try:
        coefs = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--aux-coefs takes comma-separated numbers, got {text!r}") from None
    if not coefs or min(coefs) < 0 or len(set(coefs)) != len(coefs):
        raise SystemExit(f"--aux-coefs needs distinct coefficients >= 0, got {text!r}")
    return sorted(coefs)


def load_summary(runs: list[dict], limit: float, floor: float) -> dict:
    """A coefficient's runs -> the final router load on the probe batches, as share x E (1 = fair
    share): per seed the busiest expert in any layer and the least-used one, and whether every
    seed and layer meets the balance criterion (busiest <= limit, least-used >= floor)."""
    import numpy as np

    final = np.asarray([r["load"][-1] for r in runs]) * EXPERTS  # (seeds, L, E) share x E
    busiest, least = final.max((1, 2)), final.min((1, 2))
    return {"busiest": expkit.stats(busiest), "least": expkit.stats(least),
            "busiest_per_layer": final.max(-1).tolist(), "least_per_layer": final.min(-1).tolist(),
            "balanced": bool(busiest.max() <= limit and least.min() >= floor)}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    started, before = time.perf_counter(), uptime()

    def extra(p):
        p.add_argument("--steps", type=int, default=300, help="updates per run (default 300)")
        p.add_argument("--aux-coefs", default=",".join(map(str, AUX_COEFS)),
                       help=f"load-balancing loss coefficients swept, comma-separated (default {AUX_COEFS})")
        p.add_argument("--aux-per-layer", action="store_true",
                       help="load-balancing loss per layer, averaged (moe.aux_loss_scope='layer') instead of pooled")
        p.add_argument("--z-coef", type=float, default=0.0, help="router z-loss coefficient of every MoE run (default 0)")
        p.add_argument("--grouped-steps", type=int, default=20, help="updates timed with moe.impl='grouped' (0: skip)")

    args = expkit.parse(__doc__, NAME, extra=extra)
    args.aux_coefs = parse_coefs(args.aux_coefs)
    if args.smoke:
        args.steps, args.seeds, args.grouped_steps = 6, 1, 2
    import jax

    scope = "layer" if args.aux_per_layer else "pooled"
    from jaxgpt.train.step import init_state
    from jaxgpt.data.tasks import load_task

    path = expkit.shakespeare()
    eval_every = max(1, args.steps // 10)
    cache: dict = {}
    arms = ["dense"] + [("moe", c) for c in args.aux_coefs]
    runs: dict = {arm: [] for arm in arms}
    sizes, grouped_ms = {}, None
    for seed in range(args.seeds):
        for arm in arms:
            kind, coef = ("dense", None) if arm == "dense" else arm
            tc = train_config(args.steps, seed, eval_every, aux_coef=coef or 0.0, z_coef=args.z_coef)
            task = load_task(model_config(kind, 65, tc.seq_len), tc, data=str(path))
            config = model_config(kind, task.tokenizer.vocab_size, tc.seq_len, aux_scope=scope)
            params0 = jax.device_get(init_state(config, tc).params)  # per seed: every MoE arm starts from the same weights
            sizes[kind] = active_params(config, params0)
            probe = load_probe(config, task.eval_batches(tc)[:2]) if kind == "moe" else None
            r = train_run(config, tc, task, params0, cache, probe)
            runs[arm].append({"seed": seed, "val_steps": r["val_steps"], "val_loss": r["val_loss"],
                              "final_val": r["val_loss"][-1], "ms_per_step": r["ms_per_step"],
                              "compile_s": r["compile_s"], "load": r["load"], "aux": r["aux"]})
            label = kind if coef is None else f"moe aux {coef:g}"
            busiest = f", busiest expert x{max(map(max, r['load'][-1])) * EXPERTS:.2f}" if r["load"] else ""
            print(f"{label} seed {seed}: val {r['val_loss'][0]:.3f} -> {r['val_loss'][-1]:.3f}{busiest}, "
                  f"{r['ms_per_step']:.1f} ms/step ({time.perf_counter() - started:.0f} s)", flush=True)
            if kind == "moe" and seed == 0 and grouped_ms is None and args.grouped_steps:
                grouped = model_config("moe", task.tokenizer.vocab_size, tc.seq_len, impl="grouped", aux_scope=scope)
                grouped_ms = time_steps(grouped, tc, task, params0, args.grouped_steps)
                print(f"moe (grouped) seed 0: {grouped_ms:.1f} ms/step", flush=True)
    sweep = {}
    for arm in arms[1:]:
        rs = runs[arm]
        sweep[f"{arm[1]:g}"] = {"aux_coef": arm[1], "final_val": expkit.stats([r["final_val"] for r in rs]),
                                "ms_per_step": expkit.stats([r["ms_per_step"] for r in rs]),
                                **load_summary(rs, BALANCE_MAX, BALANCE_MIN), "runs": rs}
    balancing = next((s["aux_coef"] for s in sweep.values() if s["balanced"]), None)
    results = {"smoke": args.smoke, "config": {"steps": args.steps, "seeds": args.seeds, "layers": 4, "width": 64, "experts": EXPERTS,
                          "top_k": TOP_K, "dense_d_ff": DENSE_FF, "expert_d_ff": EXPERT_FF, "batch_size": 16,
                          "seq_len": 64, "lr": 2e-3, "aux_coefs": args.aux_coefs, "router_z_coef": args.z_coef,
                          "aux_per_layer": args.aux_per_layer},
               "criterion": {"busiest_max": BALANCE_MAX, "least_min": BALANCE_MIN},
               "balancing_coef": balancing, "params": sizes, "grouped_ms_per_step": grouped_ms,
               "dense": {"final_val": expkit.stats([r["final_val"] for r in runs["dense"]]),
                         "ms_per_step": expkit.stats([r["ms_per_step"] for r in runs["dense"]]), "runs": runs["dense"]},
               "sweep": sweep, "uptime": {"before": before, "after": uptime()}}
    from scripts.experiments import exp_moe_report as report

    report.figures(results, args.out)
    expkit.write_results(args.out, NAME, results, report.markdown(results, report.variants(args.out)), smoke=args.smoke,
                         started=started)


if __name__ == "__main__":
    main()
