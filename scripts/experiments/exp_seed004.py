"""Experiment 5: seed 004's three trained models, on tasks generated in the package.

1. MiniBERT (preset ``seed-minibert``: 128 wide, 2 Pre-LN layers, learned positions, [CLS]
   classifier, dropout 0.1) classifying generated sentiment-like rows
   (``jaxgpt.data.generated.sentiment_rows``: filler words plus 1 or 3 sentiment words, label = the
   majority polarity; variable lengths, so every batch is padded and the padding mask matters).
   Seed 004 trains it on IMDb with Adam(1e-3, weight decay 1e-5), clip 1.0, batch 16 (not shipped
   here, and not reachable offline). Held-out test accuracy over training, mean and spread over 3
   seeds; and the padding mask at work: logits unchanged by extra padding with the mask, accuracy
   without it.
2. The encoder-decoder (preset ``seed-transformer``: sqrt(d)-scaled embeddings, sinusoidal
   positions, Post-LN, ReLU; 64 wide, 1 layer, 4 heads) on generated copy / reverse / sort pairs
   (``jaxgpt.data.generated.sequence_pairs``: 3-8 symbols over 10 letters): greedy exact match on
   held-out pairs (``jaxgpt.inference.translate.translate_all``), over training, 3 seeds. Seed 004 only runs
   this model forward on random ids; the task and the claim "learns to high exact match" are the
   issue's.
3. Seed 004's tiny character GPT: "hello world! this is a tiny gpt demo.", 128 wide, 2 Pre-LN
   layers, learned positions, exact GELU, biases everywhere including the output Linear
   (``lm_head_bias=True``), Adam lr 1e-3, 200 steps of one random 8-character window, then 50
   characters sampled at T=1 from "h". Side by side with the seed's own torch code (copied below),
   3 seeds each.

Claims (seed 004 prints losses and samples; it states no numbers): the models train (loss falls,
accuracy rises above chance), the padding mask keeps padding out of the [CLS] vector, and the
tiny GPT's samples resemble its text. The issue adds: high exact-match accuracy on copy / reverse
/ sort.

Default budget: about 5 minutes on a quiet 2-core CPU (3 seeds of each part; 695 s measured with
the machine shared by ~10 other busy processes); ``--smoke``: one seed, 20 steps per part, copy only
(about a minute of CPU time).

    .venv/bin/python -m scripts.experiments.exp_seed004 [--smoke] [--seeds N] [--out DIR]
"""
from __future__ import annotations

import time

import numpy as np

from scripts.experiments import expkit

NAME = "seed004"
TASKS = ("copy", "reverse", "sort")


def _frac(n_test: int, n: int) -> float:
    """val_fraction that makes _split_rows hold out exactly the last n_test rows."""
    f = n_test / n
    assert round(n * f) == n_test
    return f


def _final(history: list[dict], key: str):
    vals = [r[key] for r in history if key in r]
    return vals[-1] if vals else None


# ---------------------------------------------------------------------------------------------
# 1. MiniBERT
# ---------------------------------------------------------------------------------------------
class WordTokenizer:
    """Whole words as tokens, after ``<pad> <bos> <eos> <sep>`` (PairTokenizer's specials and ids).
    Seed 004 feeds MiniBERT bert-base-uncased WordPiece ids, where every word of the generated
    rows is one token; this is that vocabulary for the generated words."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>")
    pad_id, bos_id, eos_id, sep_id = range(4)
    kind = "word"

    def __init__(self, texts):
        self.vocab = [*self.SPECIALS, *sorted({w for t in texts for w in t.split()})]
        self._ids = {w: i for i, w in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([self._ids[w] for w in text.split()], np.int32)


def minibert(args, budget: dict) -> tuple[dict, list]:
    import jax.numpy as jnp

    from jaxgpt import PRESETS, build
    from jaxgpt.config import TrainConfig
    from jaxgpt.data import pad_batch
    from jaxgpt.data.generated import sentiment_rows, split_rows
    from jaxgpt.data.tasks import classify_task, fit_config

    n_train, n_test, steps = budget["bert_rows"], budget["bert_test"], budget["bert_steps"]
    rows = sentiment_rows(n_train + n_test, seed=0)
    train_rows, test_rows = split_rows(rows, n_test, seed=0, key=1)
    all_rows = train_rows + test_rows
    words = args.bert_tokens == "word"
    seq_len = 1 + max(len(t.split()) for _, t in all_rows) if words else 64
    runs, finals, mask_checks = [], [], []
    for seed in range(args.seeds):
        tc = TrainConfig(steps=steps, batch_size=16, seq_len=seq_len, lr=1e-3, beta1=0.9, beta2=0.999,
                         weight_decay=1e-5, grad_clip=1.0, schedule="constant", seed=seed,
                         val_fraction=_frac(len(test_rows), len(all_rows)),
                         eval_batches=-(-len(test_rows) // 16), log_every=10)
        tokenizer = WordTokenizer(t for _, t in all_rows) if words else None
        task = classify_task(all_rows, tc, tokenizer=tokenizer, source="generated:sentiment_rows")
        base = PRESETS["seed-minibert"]
        config = fit_config(base, task)
        r = expkit.train(config, tc.replace(eval_every=budget["bert_eval_every"]), task)
        hist = r["history"]
        steps_acc = [(h["step"], h["val_accuracy"]) for h in hist if "val_accuracy" in h]
        runs.append(([s for s, _ in steps_acc], [a for _, a in steps_acc]))
        finals.append(_final(hist, "val_accuracy"))

        # The padding mask at work: the same test texts padded to 64 and to 128 ids.
        model, params = build(config), r["params"]
        tok = task.tokenizer
        ids = [[tok.bos_id, *tok.encode(t)] for _, t in test_rows]
        labels = np.asarray([int(lab) for lab, _ in test_rows])
        logits = {}
        for width in (seq_len, 2 * seq_len):  # (64, 128) below means (seq_len, 2 * seq_len)
            x, m = pad_batch(ids, width, tok.pad_id, truncate=True)
            width_key = 64 if width == seq_len else 128
            logits[(width_key, True)] = np.asarray(model.apply({"params": params}, jnp.asarray(x), jnp.asarray(m)))
            logits[(width_key, False)] = np.asarray(model.apply({"params": params}, jnp.asarray(x),
                                                            jnp.ones_like(jnp.asarray(m))))
        mask_checks.append({
            "max_logit_diff_pad64_vs_pad128_with_mask": float(np.abs(logits[(64, True)] - logits[(128, True)]).max()),
            "max_logit_diff_pad64_vs_pad128_without_mask": float(np.abs(logits[(64, False)] - logits[(128, False)]).max()),
            "test_accuracy_with_mask": float((logits[(64, True)].argmax(-1) == labels).mean()),
            "test_accuracy_without_mask_pad64": float((logits[(64, False)].argmax(-1) == labels).mean()),
            "test_accuracy_without_mask_pad128": float((logits[(128, False)].argmax(-1) == labels).mean()),
        })
        print(f"minibert seed {seed}: test accuracy {finals[-1]:.3f} ({r['compile_s']:.1f} s compile, "
              f"{r['train_s']:.1f} s training, "
              f"{r['ms_per_step']:.1f} ms/step)")
    expkit.plot_runs({"MiniBERT (seed-minibert), held-out test accuracy": runs}, args.out / "minibert_accuracy.png",
                     ylabel="test accuracy", title=f"MiniBERT on generated sentiment rows ({len(train_rows)} train / "
                     f"{len(test_rows)} test), batch 16, Adam 1e-3")
    acc = expkit.stats(finals)
    mc = {k: expkit.stats([c[k] for c in mask_checks]) for k in mask_checks[0]}
    res = {"train_rows": len(train_rows), "test_rows": len(test_rows), "steps": steps, "seq_len": seq_len,
           "tokens": args.bert_tokens, "vocab_size": task.tokenizer.vocab_size,
           "examples": test_rows[:6], "final_test_accuracy": acc, "curves": runs, "padding_mask": mc,
           "per_seed_padding_mask": mask_checks}
    with_m = mc["max_logit_diff_pad64_vs_pad128_with_mask"]["max"]
    rows = [
        ["004", "MiniBERT learns sentence classification (seed: IMDb; here generated sentiment rows)",
         f"held-out test accuracy {expkit.pm(acc)} after {steps} steps ({args.bert_tokens} tokens; chance 0.5)",
         "holds" if acc["min"] is not None and acc["min"] > 0.8 else f"does not hold (measured {expkit.pm(acc)})"],
        ["004", "the padding mask keeps padding out of the [CLS] vector",
         f"with the mask, padding to {2 * seq_len} instead of {seq_len} ids changes the logits by at most {with_m:.1e}; "
         "without it by "
         f"{mc['max_logit_diff_pad64_vs_pad128_without_mask']['mean']:.2f} (mean over seeds of the max); test accuracy "
         f"with the mask {mc['test_accuracy_with_mask']['mean']:.3f}, without it "
         f"{mc['test_accuracy_without_mask_pad64']['mean']:.3f} (padded to {seq_len}) and "
         f"{mc['test_accuracy_without_mask_pad128']['mean']:.3f} (padded to {2 * seq_len})",
         "holds" if with_m < 1e-4 else f"does not hold (measured {with_m:.1e})"],
    ]
    return res, rows


# ---------------------------------------------------------------------------------------------
# 2. encoder-decoder on copy / reverse / sort
# ---------------------------------------------------------------------------------------------
def encdec(args, budget: dict) -> tuple[dict, list]:

    from jaxgpt import PRESETS
    from jaxgpt.config import TrainConfig
    from jaxgpt.data.generated import sequence_pairs, split_rows
    from jaxgpt.data.tasks import fit_config, pairs_task
    from jaxgpt.inference.translate import translate_all

    res: dict = {}
    rows_out, curves = [], {}
    steps = budget["encdec_steps"]
    tasks = TASKS[:1] if args.smoke else TASKS  # smoke: copy only (the three differ only in their data)
    for name in tasks:
        pairs = sequence_pairs(name, budget["encdec_pairs"], seed=0, min_len=3, max_len=8)
        train_pairs, test_pairs = split_rows(pairs, budget["encdec_test"], seed=0, key=0)
        all_pairs = train_pairs + test_pairs
        finals, runs, train_acc, samples = [], [], [], None
        for seed in range(args.seeds):
            tc = TrainConfig(steps=steps, batch_size=32, seq_len=9, lr=1e-3, beta2=0.98, warmup_steps=min(100, steps // 5),
                             weight_decay=0.0, grad_clip=1.0, seed=seed, val_fraction=_frac(len(test_pairs), len(all_pairs)),
                             eval_batches=1, log_every=25)
            task = pairs_task(all_pairs, tc, seq2seq=True, source=f"generated:{name}")
            base = PRESETS["seed-transformer"]
            base = base.replace(encoder=base.encoder.replace(max_len=16), decoder=base.decoder.replace(max_len=16))
            config = fit_config(base, task)
            tok = task.tokenizer
            on_eval = lambda step, params: {"exact": translate_all(config, params, tok, test_pairs)["accuracy"]}  # noqa: B023 - called in this iteration
            r = expkit.train(config, tc.replace(eval_every=budget["encdec_eval_every"]), task, on_eval=on_eval)
            pts = [(h["step"], h["exact"]) for h in r["history"] if "exact" in h]
            runs.append(([s for s, _ in pts], [a for _, a in pts]))
            test = translate_all(config, r["params"], tok, test_pairs)
            finals.append(test["accuracy"])
            train_acc.append(translate_all(config, r["params"], tok, train_pairs[:len(test_pairs)])["accuracy"])
            if samples is None:
                samples = [{"src": s, "tgt": t, "out": o} for (s, t), o in zip(test_pairs[:8], test["outputs"])]
            print(f"encdec {name} seed {seed}: held-out exact {test['exact']}/{test['n']} "
                  f"({r['compile_s']:.1f} s compile, {r['train_s']:.1f} s training, {r['ms_per_step']:.1f} ms/step)")
            curves[name] = runs
        acc = expkit.stats(finals)
        res[name] = {"train_pairs": len(train_pairs), "test_pairs": len(test_pairs), "steps": steps,
                     "heldout_exact_match": acc, "train_exact_match_first_n": expkit.stats(train_acc),
                     "curves": runs, "samples": samples}
        rows_out.append(["issue", f"the encoder-decoder learns {name} to high exact match on held-out pairs",
                         f"greedy exact match on {len(test_pairs)} held-out pairs: {expkit.pm(acc)} after {steps} steps "
                         f"(training pairs: {expkit.stats(train_acc)['mean']:.3f})",
                         "holds" if acc["min"] is not None and acc["min"] >= 0.9 else
                         f"does not hold (measured {expkit.pm(acc)}; 'high' read as >= 0.9 for every seed)"])
    expkit.plot_runs({f"{n} ({res[n]['train_pairs']} train pairs)": curves[n] for n in tasks},
                     args.out / "encdec_exact_match.png", ylabel="held-out exact match (greedy)",
                     title="seed-transformer (64 wide, 1 layer, Post-LN) on generated sequence tasks")
    res["config"] = "seed-transformer, max_len 16; AdamW lr 1e-3 (betas 0.9/0.98), warmup, cosine to 0.1x, batch 32"
    return res, rows_out


# ---------------------------------------------------------------------------------------------
# 3. tiny character GPT
# ---------------------------------------------------------------------------------------------
def _bigram_fraction(sample: str, text: str) -> float:
    grams = {text[i:i + 2] for i in range(len(text) - 1)}
    pairs = [sample[i:i + 2] for i in range(len(sample) - 1)]
    return sum(p in grams for p in pairs) / max(len(pairs), 1)


def _longest_common(sample: str, text: str) -> str:
    best = ""
    for i in range(len(sample)):
        for j in range(i + len(best) + 1, len(sample) + 1):
            if sample[i:j] in text:
                best = sample[i:j]
            else:
                break
    return best


def _windows(ids: np.ndarray, t: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Every t-character training window of the sentence: x, y (N, t)."""
    w = np.stack([ids[s:s + t + 1] for s in range(len(ids) - t)])
    return w[:, :-1], w[:, 1:]


def _all_windows_loss_jax(config, params, ids: np.ndarray) -> float:
    """Mean next-character loss over every 8-character window (what training draws from)."""
    import jax
    import jax.numpy as jnp

    from jaxgpt import build

    x, y = _windows(ids)
    logits = build(config).apply({"params": params}, jnp.asarray(x))
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return float(-jnp.take_along_axis(lp, jnp.asarray(y[..., None]), -1).mean())


def seed_torch_tiny_gpt(text: str, steps: int, seed: int) -> dict | None:
    """Seed 004's own code ("极简GPT模型示例"), trimmed of prints; None without torch."""
    try:
        import torch
        import torch.nn as tnn
        import torch.nn.functional as F
    except ImportError:
        return None

    class SelfAttention(tnn.Module):
        def __init__(self, embed_dim, num_heads, max_len=128):
            super().__init__()
            self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
            self.qkv = tnn.Linear(embed_dim, 3 * embed_dim)
            self.out = tnn.Linear(embed_dim, embed_dim)
            self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)))

        def forward(self, x):
            B, L, D = x.size()
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (t.view(B, L, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-2, -1) / (self.head_dim ** 0.5)
            scores = scores.masked_fill(self.mask[:L, :L] == 0, float("-inf"))
            out = F.softmax(scores, dim=-1) @ v
            return self.out(out.transpose(1, 2).contiguous().view(B, L, D))

    class GPTBlock(tnn.Module):
        def __init__(self, embed_dim, num_heads, hidden_dim, max_len=128):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(embed_dim), tnn.LayerNorm(embed_dim)
            self.attn = SelfAttention(embed_dim, num_heads, max_len=max_len)
            self.fc1, self.fc2 = tnn.Linear(embed_dim, hidden_dim), tnn.Linear(hidden_dim, embed_dim)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class MiniGPT(tnn.Module):
        def __init__(self, vocab_size, max_len=128, embed_dim=128, num_heads=4, num_layers=2, hidden_dim=256):
            super().__init__()
            self.token_emb = tnn.Embedding(vocab_size, embed_dim)
            self.pos_emb = tnn.Embedding(max_len, embed_dim)
            self.blocks = tnn.ModuleList([GPTBlock(embed_dim, num_heads, hidden_dim, max_len) for _ in range(num_layers)])
            self.ln = tnn.LayerNorm(embed_dim)
            self.fc_out = tnn.Linear(embed_dim, vocab_size)

        def forward(self, x):
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            x = self.token_emb(x) + self.pos_emb(pos)
            for block in self.blocks:
                x = block(x)
            return self.fc_out(self.ln(x))

    torch.set_num_threads(1)  # a 37-character model: more threads only contend with JAX's
    torch.manual_seed(seed)
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    model = MiniGPT(len(vocab), max_len=64, embed_dim=128, num_heads=4, num_layers=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(data) - 10, (1,))
        x, y = data[idx:idx + 8].unsqueeze(0), data[idx + 1:idx + 9].unsqueeze(0)
        loss = F.cross_entropy(model(x).view(-1, len(vocab)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        x, y = (torch.from_numpy(a).long() for a in _windows(data.numpy()))
        full = F.cross_entropy(model(x).reshape(-1, len(vocab)), y.reshape(-1)).item()
        ctx = torch.tensor([[stoi["h"]]])
        for _ in range(50):
            probs = F.softmax(model(ctx)[0, -1], dim=-1)
            ctx = torch.cat([ctx, torch.multinomial(probs, 1).unsqueeze(0)], dim=1)
    return {"losses": losses, "windows_loss": full, "sample": "".join(vocab[i] for i in ctx[0].tolist()),
            "seconds": seconds}


def tiny_gpt(args, budget: dict) -> tuple[dict, list]:
    import jax

    from jaxgpt.config import ModelConfig, TrainConfig
    from jaxgpt.inference.generate import generate
    from jaxgpt.data.generated import TINY_GPT_TEXT
    from jaxgpt.data.tasks import text_task

    text, steps = TINY_GPT_TEXT, budget["gpt_steps"]
    out: dict = {"text": text, "steps": steps, "jaxgpt": [], "seed_torch": []}
    for seed in range(args.seeds):
        tc = TrainConfig(steps=steps, batch_size=1, seq_len=8, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                         grad_clip=None, schedule="constant", val_fraction=0.0, seed=seed, log_every=1)
        task = text_task(text, tc, source="seed004:tiny-gpt")
        tok = task.tokenizer
        config = ModelConfig(vocab_size=tok.vocab_size, d_model=128, n_head=4, n_layer=2, d_ff=256, max_len=64,
                             pos="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu", mlp_bias=True, qkv_bias=True,
                             o_bias=True, lm_head_bias=True)
        r = expkit.train(config, tc, task)
        losses = [h["loss"] for h in r["history"] if "loss" in h]
        ids = np.asarray(tok.encode(text))
        sample_ids = np.asarray(generate(config, r["params"], np.asarray([tok.encode("h")]), 50,
                                         temperature=1.0, rng=jax.random.PRNGKey(seed)))[0]
        sample = tok.decode(sample_ids.tolist())
        out["jaxgpt"].append({"seed": seed, "losses": losses, "windows_loss": _all_windows_loss_jax(config, r["params"], ids),
                              "sample": sample, "compile_s": r["compile_s"], "train_s": r["train_s"],
                              "ms_per_step": r["ms_per_step"]})
        print(f"tiny gpt (jaxgpt) seed {seed}: last-20 loss {np.mean(losses[-20:]):.3f}; sample {sample!r}")
        t = seed_torch_tiny_gpt(text, steps, seed)
        if t is not None:
            out["seed_torch"].append({"seed": seed, **t})
            print(f"tiny gpt (seed's torch code) seed {seed}: last-20 loss {np.mean(t['losses'][-20:]):.3f}; "
                  f"sample {t['sample']!r}")

    runs = {"jaxgpt (lm_head_bias=True)": [(list(range(1, len(r["losses"]) + 1)), r["losses"]) for r in out["jaxgpt"]]}
    if out["seed_torch"]:
        runs["seed 004's torch code"] = [(list(range(1, len(r["losses"]) + 1)), r["losses"]) for r in out["seed_torch"]]
    expkit.plot_runs(runs, args.out / "tiny_gpt_loss.png", ylabel="training loss (one 8-char window, smoothed 10)",
                     title=f"seed 004 tiny character GPT on {text!r}", smooth_window=10)

    summary = {}
    for side in ("jaxgpt", "seed_torch"):
        rs = out[side]
        if not rs:
            continue
        summary[side] = {
            "first_loss": expkit.stats([r["losses"][0] for r in rs]),
            "last20_loss": expkit.stats([float(np.mean(r["losses"][-20:])) for r in rs]),
            "windows_loss": expkit.stats([r["windows_loss"] for r in rs]),
            "sample_bigram_fraction": expkit.stats([_bigram_fraction(r["sample"], text) for r in rs]),
            "longest_substring_of_text": [_longest_common(r["sample"], text) for r in rs],
            "samples": [r["sample"] for r in rs],
        }
    out["summary"] = summary
    j = summary["jaxgpt"]
    t = summary.get("seed_torch")
    cmp = (f"; the seed's torch code: {t['first_loss']['mean']:.2f} -> {t['last20_loss']['mean']:.3f}, all windows "
           f"{expkit.pm(t['windows_loss'])}" if t else "; torch not installed, the seed's code not run")
    rows = [
        ["004", "the tiny character GPT learns its sentence in 200 steps (loss printed every 50 steps falls)",
         f"jaxgpt: loss {j['first_loss']['mean']:.2f} at step 1 -> {j['last20_loss']['mean']:.3f} (mean of the last 20 "
         f"steps), loss over all 8-character windows {expkit.pm(j['windows_loss'])}{cmp}",
         "holds" if j["windows_loss"]["mean"] < 0.5 * j["first_loss"]["mean"] else
         f"does not hold (measured {expkit.pm(j['windows_loss'])})"],
        ["004", "sampling from 'h' (T=1) generates text like the training sentence",
         f"{100 * j['sample_bigram_fraction']['mean']:.0f}% of sampled character pairs occur in the sentence "
         f"(seed's code: {100 * t['sample_bigram_fraction']['mean']:.0f}%)" if t else
         f"{100 * j['sample_bigram_fraction']['mean']:.0f}% of sampled character pairs occur in the sentence"
         + f"; e.g. {j['samples'][0]!r}",
         "holds" if j["sample_bigram_fraction"]["mean"] > 0.8 else
         f"does not hold (measured {j['sample_bigram_fraction']['mean']:.2f} of pairs)"],
    ]
    return out, rows


BUDGETS = {
    "default": {"bert_rows": 2000, "bert_test": 400, "bert_steps": 600, "bert_eval_every": 50,
                "encdec_pairs": 2400, "encdec_test": 200, "encdec_steps": 1000, "encdec_eval_every": 200,
                "gpt_steps": 200},
    "smoke": {"bert_rows": 200, "bert_test": 48, "bert_steps": 20, "bert_eval_every": 10,
              "encdec_pairs": 200, "encdec_test": 32, "encdec_steps": 20, "encdec_eval_every": 10,
              "gpt_steps": 20},
}


def main() -> None:
    args = expkit.parse(__doc__, NAME, seeds=3, extra=lambda p: p.add_argument(
        "--bert-tokens", choices=("word", "char"), default="word",
        help="MiniBERT input tokens: whole words (default; the seed's WordPiece ids are whole words for this "
             "vocabulary) or characters"))
    if args.smoke:
        args.seeds = 1
    budget = BUDGETS["smoke" if args.smoke else "default"]
    started = time.perf_counter()
    results: dict = {"budget": budget, "seeds": args.seeds}
    rows = []
    for key, fn in (("minibert", minibert), ("encdec", encdec), ("tiny_gpt", tiny_gpt)):
        t0 = time.perf_counter()
        results[key], r = fn(args, budget)
        results[key]["wall_s"] = round(time.perf_counter() - t0, 1)
        rows += r
        print(f"{key}: {time.perf_counter() - t0:.1f} s")
    results["claims"] = [dict(zip(("seed", "claim", "measured", "verdict"), r)) for r in rows]
    tg = results["tiny_gpt"]["summary"]
    md = ["# Experiment 5: seed 004 (MiniBERT, encoder-decoder, tiny character GPT)\n",
          f"Command: `.venv/bin/python -m scripts.experiments.exp_seed004{' --smoke' if args.smoke else ''}` "
          f"({args.seeds} seed(s) per part; wall time {time.perf_counter() - started:.0f} s on the 2-core CPU, "
          "measured under load: other jobs shared the machine). Data: `jaxgpt.data.generated` (deterministic, seed 0).\n",
          expkit.table(["source", "claim", "measured", "verdict"], [[str(c).replace("|", "\\|") for c in r] for r in rows]),
          "\n## Setup and differences from the seed\n",
          f"- MiniBERT: preset `seed-minibert` (dropout 0.1) on {results['minibert']['tokens']} tokens "
          f"(vocabulary {results['minibert']['vocab_size']}, seq_len {results['minibert']['seq_len']} with [CLS]), "
          f"{results['minibert']['train_rows']} training / {results['minibert']['test_rows']} test rows (no test text "
          "occurs in training), batch 16, lr 1e-3 constant, betas (0.9, 0.999), clip 1.0. The seed uses IMDb "
          "through bert-base-uncased WordPiece ids (not available offline; every generated word would be one "
          "WordPiece token, hence word tokens by default; `--bert-tokens char` reads characters instead) and torch "
          "Adam's L2 weight decay 1e-5, where jaxgpt decays 1e-5 decoupled (AdamW).",
          "- Encoder-decoder: preset `seed-transformer` (1 layer each side, 64 wide, Post-LN, ReLU, sqrt(d) "
          "embedding scale, sinusoidal positions, output bias) with max_len 16; sources of 3-8 symbols over "
          "`abcdefghij`; greedy decoding with `jaxgpt.inference.translate.translate_all`; exact match = the whole output "
          "string equals the target. " + results["encdec"]["config"] + ".",
          "- Tiny GPT: the seed's model in jaxgpt (`pos=learned`, LayerNorm, exact GELU, biases, "
          "`lm_head_bias=True` for the seed's `fc_out` Linear); Adam lr 1e-3, no weight decay, no clipping, batch 1 "
          "of 8 characters. jaxgpt initialises N(0, 0.02) where torch uses its default (uniform) init, and draws "
          "window starts in [0, 29) where the seed draws [0, 27); the seed's own code runs beside it for comparison. "
          "Its training loss falls faster than jaxgpt's (see the figure); the inits differ (torch: nn.Embedding "
          "N(0, 1) and kaiming-uniform Linears; jaxgpt N(0, 0.02)), which is the likely cause (not isolated here).",
          "- The seed trains on 8-character windows but samples 50 characters from 'h' with the whole context, so "
          "positions 8-50 use learned position embeddings that training never updates (in the seed's code and "
          "here alike); the samples drift after the first words for that reason as much as for the model.",
          "\n## Samples (tiny GPT, T = 1, prompt 'h')\n"]
    for side in ("jaxgpt", "seed_torch"):
        if side in tg:
            for s in tg[side]["samples"]:
                md.append(f"- {'jaxgpt' if side == 'jaxgpt' else 'seed code'}: `{s}`")
    md.append("\n## Encoder-decoder held-out samples (seed 0)\n")
    md.append(expkit.table(["task", "source", "target", "greedy output"],
                           [[n, s["src"], s["tgt"], s["out"]] for n in TASKS if n in results["encdec"]
                            for s in results["encdec"][n]["samples"][:3]]))
    md += ["\n## Figures\n", "![MiniBERT test accuracy](minibert_accuracy.png)\n",
           "![encoder-decoder exact match](encdec_exact_match.png)\n", "![tiny GPT loss](tiny_gpt_loss.png)\n"]
    expkit.write_results(args.out, NAME, results, "\n".join(md), smoke=args.smoke, started=started)


if __name__ == "__main__":
    main()
