"""The pieces of exp_minigpt.py: cached training runs, the long (epoch) run, the torch_ref
side, KV-cache timing, samples, attention heatmaps, the claims and the README."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from jaxgpt.config import ModelConfig
from scripts.experiments import expkit, torch_side as torch_worker
from scripts.experiments.torch_side import flatten, unflatten

CORPUS = "seed-synthetic"
TOL_FINAL = 0.01  # |jaxgpt - torch_ref| on the final loss (mean of the last 20 steps), fixed before measuring


def val_fraction() -> float:
    """0 (the seed trains on the whole text) when TrainConfig supports it, else the default 0.1."""
    from jaxgpt.config import TrainConfig

    try:
        TrainConfig(val_fraction=0.0)
        return 0.0
    except ValueError:
        return 0.1


def load_params(path: Path) -> dict:
    with np.load(path) as z:
        return unflatten(z)


def _setup(preset: str, over: dict, tc):
    from jaxgpt.config import get_preset
    from jaxgpt.data.tasks import fit_config, load_task

    config = get_preset(preset).replace(**over)
    task = load_task(config, tc, corpus=CORPUS)
    config = fit_config(config, task)
    return config, task  # Execution's 'auto' unrolls the layer loop on the CPU


def tokenizer():
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.tasks import load_task

    tc = TrainConfig(val_fraction=val_fraction())
    return load_task(ModelConfig(), tc, corpus=CORPUS).tokenizer


def _key(*what) -> str:
    """Cache key of a run: what defines it (not the whole config dicts, which grow new fields)."""
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]


def run_steps(config, tc, task, n_steps: int, *, log_every: int = 50) -> dict:
    """The first ``n_steps`` updates of the run ``tc`` describes (its schedule may be longer: the seed's
    15 epochs): ``expkit.train`` (jaxgpt's fit) with ``until``. Loss of every step; ms/step is the
    median over windows of ``log_every`` steps, compile_s apart."""
    import jax

    from jaxgpt.train.step import init_state

    init = jax.device_get(init_state(config, tc).params)
    r = expkit.train(config, tc.replace(log_every=log_every), task, params=init, until=n_steps)
    return {"losses": [h["loss"] for h in r["history"] if "loss" in h], "init": init,
            "params": jax.device_get(r["params"]), "compile_s": r["compile_s"], "train_s": r["train_s"],
            "ms_per_step": r["ms_per_step"]}


def train_run(name: str, preset: str, over: dict, seed: int, n_steps: int, cache: Path, *, fresh: bool,
              keep: bool = False, schedule: str = "15ep", cached_only: bool = False) -> dict | None:
    """One cached run: {losses (every step), ms_per_step, config, tc, steps_per_epoch, and with
    ``keep`` the npz paths of its initial ('init') and final ('params') weights}.

    schedule '15ep': the first ``n_steps`` updates of the seed's run, 15 epochs with the cosine over
    all of them (TrainConfig(epochs=15) + with_epochs); '500': TrainConfig(steps=n_steps), the
    cosine compressed into the steps run."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.tasks import with_epochs

    vf = val_fraction()
    if schedule == "15ep":
        tc = TrainConfig(epochs=15, seed=seed, val_fraction=vf)
        key = _key(preset, over, seed, n_steps, vf, schedule)
    else:
        tc = TrainConfig(steps=n_steps, seed=seed, val_fraction=vf)
        key = _key(preset, over, seed, n_steps, vf)
    config, task = _setup(preset, over, tc)
    tc = with_epochs(tc, task)
    stem = cache / f"{name}_s{seed}_{key}"
    path = stem.with_suffix(".json")
    if path.exists() and not fresh:
        print(f"cached: {path.name}")
        return {**json.loads(path.read_text()), "from_cache": True}
    if cached_only:
        print(f"missing (--cached-only): {name} seed {seed}")
        return None
    print(f"training {name} seed {seed}: {n_steps} steps ({schedule})", flush=True)
    r = run_steps(config, tc, task, n_steps)
    rec = {"name": name, "seed": seed, "schedule": schedule, "losses": r["losses"], "ms_per_step": r["ms_per_step"],
           "train_s": r["train_s"], "compile_s": r["compile_s"], "config": config.to_dict(), "tc": tc.to_dict(),
           "steps_per_epoch": task.steps_per_epoch(tc), "val_fraction": vf}
    if keep:
        rec["init"], rec["params"] = str(stem) + "_init.npz", str(stem) + "_params.npz"
        np.savez(rec["init"], **flatten(r["init"]))
        np.savez(rec["params"], **flatten(r["params"]))
    print(f"  loss {rec['losses'][0]:.3f} -> {np.mean(rec['losses'][-20:]):.3f}, {r['ms_per_step']:.1f} ms/step",
          flush=True)
    path.write_text(json.dumps(rec))
    return rec


def steps_per_epoch() -> int:
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.tasks import load_task

    tc = TrainConfig(val_fraction=val_fraction())
    return load_task(_setup("seed-minigpt", {}, tc)[0], tc, corpus=CORPUS).steps_per_epoch(tc)


def cached(path: Path, fresh: bool, fn):
    """fn() -> JSON-able dict, kept in ``path``."""
    if path.exists() and not fresh:
        return json.loads(path.read_text())
    out = fn()
    path.write_text(json.dumps(out))
    return out


def torch_side(base0: dict, steps: int, cache: Path, out: Path, *, fresh: bool) -> dict:
    """The first ``steps`` of seed 0's baseline again in torch_ref (own process), same initial weights."""
    path = cache / (Path(base0["init"]).name.replace("_init.npz", f"_torch{steps}.json"))
    if fresh or not path.exists():
        from jaxgpt.config import TrainConfig

        print("torch_ref run (separate process)", flush=True)
        t = torch_worker.run(ModelConfig.from_dict(base0["config"]), TrainConfig.from_dict(base0["tc"]), CORPUS,
                             load_params(Path(base0["init"])), steps=steps)
        path.write_text(json.dumps(t))
    t = json.loads(path.read_text())
    j, r = np.asarray(base0["losses"][:steps]), np.asarray(t["losses"])
    fj, fr = float(j[-20:].mean()), float(r[-20:].mean())
    diff = np.abs(j - r)
    pyplot = expkit.plt()
    fig, (a0, a1) = pyplot.subplots(1, 2, figsize=(10, 3.8))
    s = np.arange(1, len(j) + 1)
    a0.plot(s, j, label=f"jaxgpt ({base0['ms_per_step']:.0f} ms/step)", lw=1.2)
    a0.plot(s, r, "--", label=f"torch_ref ({t['ms_per_step']:.0f} ms/step)", lw=1.2)
    a0.set(yscale="log", xlabel="step", ylabel="training loss", title="same init, same batches")
    a0.legend()
    a1.semilogy(s, np.maximum(diff, 1e-9))
    a1.set(xlabel="step", ylabel="|jaxgpt - torch_ref|", title="per-step loss difference")
    for a in (a0, a1):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "cross_framework.png", dpi=110)
    pyplot.close(fig)
    return {"final_loss_jax": fj, "final_loss_torch": fr, "final_abs_diff": abs(fj - fr), "tolerance": TOL_FINAL,
            "within_tolerance": abs(fj - fr) <= TOL_FINAL, "max_abs_diff_first_20_steps": float(diff[:20].max()),
            "max_abs_diff_all_steps": float(diff.max()), "ms_per_step_jax": base0["ms_per_step"],
            "ms_per_step_torch": t["ms_per_step"], "torch_version": t["torch"], "torch_threads": t["threads"],
            "losses_torch": [round(v, 5) for v in t["losses"]]}


def kv_cache(config, params, tokenizer, out: Path, *, smoke: bool) -> dict:
    """Greedy decoding time vs length: jaxgpt.inference.generate with its KV cache; an uncached loop that
    recomputes the growing prefix every token (the seed's baseline; prefix padded to a multiple
    of 16 positions, which a causal model ignores, so that 16 shapes compile instead of one per
    length); and jaxgpt.inference.generate(use_cache=False) (a fixed max_len window every token)."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.inference.generate import generate
    from jaxgpt.models.decoder import DecoderLM

    model, bucket = DecoderLM(config), 16
    next_tok = jax.jit(lambda p, w, n: jnp.argmax(model.apply({"params": p}, w)[0, n - 1]))
    prompt = np.asarray(tokenizer.encode("abcdefgabcdefgab"), np.int32)[None]
    lengths = [4] if smoke else [16, 32, 64, 128, 240]
    repeats = 1 if smoke else 3

    def growing(n_new):
        toks = list(prompt[0])
        for _ in range(n_new):
            n = len(toks)
            w = np.zeros((1, min(-(-n // bucket) * bucket, config.max_len)), np.int32)
            w[0, :n] = toks
            toks.append(int(next_tok(params, w, n)))
        return np.asarray(toks)[None]

    for b in range(bucket, prompt.shape[1] + max(lengths) + bucket, bucket):  # compile every shape first
        next_tok(params, np.zeros((1, min(b, config.max_len)), np.int32), 1).block_until_ready()
    methods = {"kv_cache": lambda n: np.asarray(generate(config, params, prompt, n)),
               "growing_prefix": growing,
               "fixed_window": lambda n: np.asarray(generate(config, params, prompt, n, use_cache=False))}
    rows = []
    for n in lengths:
        row, outs = {"new_tokens": n}, {}
        for m, fn in methods.items():
            outs[m] = fn(n)  # warm-up / compile
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(n)
                ts.append(time.perf_counter() - t0)
            row[f"{m}_ms"] = 1e3 * float(np.median(ts))
        row["identical"] = bool(all(np.array_equal(outs["kv_cache"], o) for o in outs.values()))
        row["speedup_vs_growing_prefix"] = row["growing_prefix_ms"] / row["kv_cache_ms"]
        row["speedup_vs_fixed_window"] = row["fixed_window_ms"] / row["kv_cache_ms"]
        rows.append(row)
        print(f"  kv {n}: {row}", flush=True)
    n = lengths[-1]
    rng = jax.random.PRNGKey(1)
    sampled_equal = bool(np.array_equal(np.asarray(generate(config, params, prompt, n, temperature=1.0, rng=rng)),
                                        np.asarray(generate(config, params, prompt, n, temperature=1.0, rng=rng,
                                                            use_cache=False))))
    return {"prompt_tokens": int(prompt.shape[1]), "rows": rows, "all_identical": all(r["identical"] for r in rows),
            "sampled_T1_cache_equals_no_cache": sampled_equal}


def kv_plot(kv: dict, out: Path) -> None:
    rows = kv["rows"]
    pyplot = expkit.plt()
    fig, (a0, a1) = pyplot.subplots(1, 2, figsize=(10, 3.8))
    x = [r["new_tokens"] for r in rows]
    for m, label in (("kv_cache", "jaxgpt.inference.generate, KV cache"), ("growing_prefix", "no cache: growing prefix"),
                     ("fixed_window", "no cache: fixed max_len window")):
        a0.plot(x, [r[f"{m}_ms"] for r in rows], "o-", label=label)
    a0.set(xscale="log", yscale="log", xlabel="new tokens (prompt 16)", ylabel="ms (median)", title="greedy decoding")
    a0.legend(fontsize=8)
    a1.plot(x, [r["speedup_vs_growing_prefix"] for r in rows], "o-", label="vs growing prefix")
    a1.plot(x, [r["speedup_vs_fixed_window"] for r in rows], "s--", label="vs fixed window")
    a1.set(xscale="log", xlabel="new tokens", ylabel="speed-up of the KV cache", title="KV-cache speed-up")
    a1.legend(fontsize=8)
    for a in (a0, a1):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "kv_cache.png", dpi=110)
    pyplot.close(fig)


def samples(config, params, tokenizer, *, smoke: bool) -> dict:
    """60 new characters for 'abcde' and 'the cat' at T = 0 / 0.5 / 1.0 / 2.0 (rng PRNGKey(0)), and
    for each the share of generated characters whose trigram (with the 2 before it) occurs in the corpus."""
    import jax

    from jaxgpt.data import builtin_corpus
    from jaxgpt.inference.generate import generate

    corpus = builtin_corpus(CORPUS)
    grams = {corpus[i:i + 3] for i in range(len(corpus) - 2)}
    out = {}
    for prompt in ("abcde",) if smoke else ("abcde", "the cat"):
        for t in (0.0, 2.0) if smoke else (0.0, 0.5, 1.0, 2.0):
            ids = generate(config, params, np.asarray(tokenizer.encode(prompt))[None], 8 if smoke else 60,
                           temperature=t, rng=jax.random.PRNGKey(0))
            text = tokenizer.decode(np.asarray(ids)[0])
            new = range(len(prompt), len(text))
            rate = float(np.mean([text[i - 2:i + 1] in grams for i in new]))
            out.setdefault(prompt, []).append({"temperature": t, "text": text, "in_corpus_trigrams": rate})
    return out


def heatmaps(config, params, tokenizer, path: Path) -> dict:
    """Attention weights of every layer and head on 'abcdefgabcdefg' (the seed's text), one grid."""
    from jaxgpt.models.decoder import DecoderLM

    text = "abcdefgabcdefg"
    out = DecoderLM(config).apply({"params": params}, np.asarray(tokenizer.encode(text))[None], return_weights=True)
    w = np.asarray(out.attn_weights)[:, 0]  # (L, H, T, T)
    L, H, T, _ = w.shape
    pyplot = expkit.plt()
    fig, axes = pyplot.subplots(L, H, figsize=(2.1 * H, 2.1 * L), squeeze=False)
    for i in range(L):
        for h in range(H):
            ax = axes[i, h]
            ax.imshow(w[i, h], cmap="Blues", vmin=0, vmax=1)
            ax.set_title(f"layer {i}, head {h}", fontsize=8)
            ax.set_xticks(range(T), list(text), fontsize=5)
            ax.set_yticks(range(T), list(text), fontsize=5)
    fig.suptitle("attention weights after training (query rows, key columns)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot.close(fig)
    t = np.arange(T)
    diag = w[..., t, t].mean(-1)
    prev = w[..., t[1:], t[1:] - 1].mean(-1)
    period = w[..., t[7:], t[7:] - 7].mean(-1) if T > 7 else np.zeros((L, H))
    return {"text": text, "max_weight_above_diagonal": float(np.triu(w, 1).max()),
            "mean_weight_on_self": _r3(diag), "mean_weight_on_previous": _r3(prev), "mean_weight_7_back": _r3(period)}


def _r3(a) -> list:
    return np.asarray(a, np.float64).round(3).tolist()
