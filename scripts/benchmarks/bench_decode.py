"""Greedy decoding speed: jaxgpt vs torch_ref vs Hugging Face generate() on the same weights.

    .venv/bin/python -m scripts.benchmarks.bench_decode            # full table -> results/engine/decode.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_decode --quick    # CI smoke: tiny shapes, one repeat, < 60 s
    .venv/bin/python -m scripts.benchmarks.bench_decode --slots    # decode-step ms/token vs cache slots only
    .venv/bin/python -m scripts.benchmarks.bench_decode --isa avx2 # every worker capped at AVX2 (harness.isa_env)
    .venv/bin/python -m scripts.benchmarks.bench_decode --family llama3  # a LlamaForCausalLM instead -> decode_llama3.*

Model: a GPT-2-style GPT2LMHeadModel (6 layers, 384 wide, 6 heads, context 1024, vocab 65 like
the shakespeare-char preset) with random weights, built from transformers.GPT2Config and saved
locally; jaxgpt and torch_ref load the same directory (jaxgpt.convert.load_hf). ``--family llama2`` /
``llama3``: a LlamaForCausalLM of the same width, depth and heads (2 KV heads, SwiGLU 1024 wide), with
plain RoPE (theta 1e4) or Llama 3's (theta 5e5, llama3 scaling of factor 8 over a quarter of the
context): the same shapes, only the RoPE constants differ. Nothing is
downloaded. Each framework runs in its own subprocess (their thread pools interfere in one
process), in rotating order, ``--repeats`` times; medians are reported. Every run's greedy
tokens are compared with jaxgpt's cached ones (``tokens_match``).

Measured per (batch, new tokens): tokens/s (batch x new tokens / wall time, compile excluded)
and time to first token (a 1-token generate). Rows:
- jax cached: ``jaxgpt.inference.generate`` (prefill + compiled while-loop over the per-layer KV cache).
- jax uncached: the prefix is recomputed every step, padded up to a multiple of 64 (so at most
  context/64 compiles; causal attention makes the padding invisible).
- torch_ref cached / uncached: ``torch_ref.generate.generate`` (uncached recomputes the exact prefix).
- hf default / hf static: ``model.generate(do_sample=False)`` with the default dynamic cache and
  with ``cache_implementation="static"``.
Uncached rows at full size are *estimated*: each step's cost depends only on the prefix length,
so the forward is timed once per 64-token bucket (at the bucket's middle length for torch) and
summed over the steps; their tokens are checked on the first 64 steps by a real generation.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.harness import ISAS, RESULTS, isa_env, median_of, report, spawn, timed as _timed

FRAMEWORKS = ("jax-cached", "jax-uncached", "torch-cached", "torch-uncached", "hf-default", "hf-static")
BUCKET = 64


# Workers (one framework per process) ----------------------------------------------------------------
def _buckets(prompt_len: int, n: int) -> dict[int, int]:
    """{padded prefix width: number of steps} of an n-token uncached generation (step j reads
    the prompt_len + j tokens so far, padded up to a multiple of BUCKET)."""
    out: dict[int, int] = {}
    for j in range(n):
        width = -(-(prompt_len + j) // BUCKET) * BUCKET
        out[width] = out.get(width, 0) + 1
    return out


def _prompt(batch: int, length: int, vocab: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (batch, length)).astype(np.int64)


def worker_jax(model_dir: str, cases, cached: bool, prompt_len: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgpt.convert.hf import load_hf
    from jaxgpt.inference.generate import generate
    from jaxgpt.models import build

    config, params = load_hf(model_dir)
    out = []
    if cached:
        for b, n in cases:
            prompt = _prompt(b, prompt_len, config.vocab_size)
            run = lambda k: np.asarray(generate(config, params, prompt, k))  # noqa: B023 - called in this iteration
            (_, compile_s), _ = _timed(lambda: run(n)), run(1)  # compile both shapes  # noqa: B023 - called in this iteration
            toks, dt = _timed(lambda: run(n))  # noqa: B023 - called in this iteration
            _, ttft = _timed(lambda: run(1))  # noqa: B023 - called in this iteration
            out.append({"batch": b, "new": n, "seconds": dt, "ttft": ttft, "compile_s": compile_s, "tokens": toks[:, prompt_len:].tolist()})
        return out
    model = build(config)
    fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))

    def step_logits(tokens):  # tokens (B, T): pad to a multiple of BUCKET, read position T-1
        t = tokens.shape[1]
        width = min(-(-t // BUCKET) * BUCKET, config.max_len)
        padded = np.zeros((tokens.shape[0], width), np.int32)
        padded[:, :t] = tokens
        return fwd(params, jnp.asarray(padded))[:, t - 1]

    for b, n in cases:
        prompt = _prompt(b, prompt_len, config.vocab_size)
        tokens = prompt.astype(np.int32)
        check = min(n, BUCKET)
        for _ in range(check):  # a real uncached generation of the first steps (token check)
            tokens = np.concatenate([tokens, np.asarray(jnp.argmax(step_logits(tokens), -1))[:, None]], 1)
        _, ttft = _timed(lambda: np.asarray(jnp.argmax(step_logits(prompt.astype(np.int32)), -1)))  # noqa: B023 - called in this iteration
        total, compile_s = 0.0, 0.0
        for width, steps in _buckets(prompt_len, n).items():  # every step of a bucket runs the same program
            probe = np.zeros((b, min(width, config.max_len)), np.int32)
            _, c = _timed(lambda: jax.block_until_ready(step_logits(probe)))  # noqa: B023 - called in this iteration
            compile_s += c
            total += median_of(lambda: jax.block_until_ready(step_logits(probe))) * steps  # noqa: B023 - called in this iteration
        out.append({"batch": b, "new": n, "seconds": total, "ttft": ttft, "compile_s": compile_s, "estimated": n > check,
                        "tokens": tokens[:, prompt_len:].tolist()})
    return out


def _torch_ref_model(model_dir: str):
    import torch

    import torch_ref.models
    from jaxgpt.convert.hf import load_hf
    from jaxgpt.core.layout import params_to_state_dict, stacked_paths

    config, params = load_hf(model_dir)
    model = torch_ref.models.build(config)
    sd = params_to_state_dict(params, stacked=stacked_paths(config))
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=True)
    return config, model.eval()


def worker_torch(model_dir: str, cases, cached: bool, prompt_len: int) -> list[dict]:
    import torch

    from torch_ref.generate import generate

    config, model = _torch_ref_model(model_dir)
    out = []
    with torch.no_grad():
        for b, n in cases:
            prompt = torch.from_numpy(_prompt(b, prompt_len, config.vocab_size))
            generate(model, prompt, 2, use_cache=cached)  # warm-up (allocator, thread pool)
            _, ttft = _timed(lambda: generate(model, prompt, 1, use_cache=cached))  # noqa: B023 - called in this iteration
            if cached:
                toks, dt = _timed(lambda: generate(model, prompt, n, use_cache=True))  # noqa: B023 - called in this iteration
                out.append({"batch": b, "new": n, "seconds": dt, "ttft": ttft, "tokens": toks[:, prompt_len:].tolist()})
                continue
            check = min(n, BUCKET)
            toks = generate(model, prompt, check, use_cache=False)
            total = 0.0
            for width, steps in _buckets(prompt_len, n).items():  # timed at the bucket's middle length
                probe = torch.zeros((b, min(width - BUCKET // 2, config.max_len)), dtype=torch.long)
                total += median_of(lambda: model(probe)) * steps  # noqa: B023 - called in this iteration
            out.append({"batch": b, "new": n, "seconds": total, "ttft": ttft, "estimated": n > check,
                            "tokens": toks[:, prompt_len:].tolist()})
    return out


def worker_hf(model_dir: str, cases, static: bool, prompt_len: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for b, n in cases:
        prompt = torch.from_numpy(_prompt(b, prompt_len, model.config.vocab_size))
        kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "attention_mask": torch.ones_like(prompt)}
        if static:
            kw["cache_implementation"] = "static"
        gen = lambda k: model.generate(prompt, max_new_tokens=k, min_new_tokens=k, **kw)  # noqa: B023 - called in this iteration
        gen(2)  # warm-up
        _, ttft = _timed(lambda: gen(1))  # noqa: B023 - called in this iteration
        toks, dt = _timed(lambda: gen(n))  # noqa: B023 - called in this iteration
        out.append({"batch": b, "new": n, "seconds": dt, "ttft": ttft, "tokens": toks[:, prompt_len:].tolist()})
    return out


def worker(args) -> None:
    cases = json.loads(args.cases)
    fw = args.worker
    if fw.startswith("jax"):
        res = worker_jax(args.model_dir, cases, fw == "jax-cached", args.prompt_len)
    elif fw.startswith("torch"):
        res = worker_torch(args.model_dir, cases, fw == "torch-cached", args.prompt_len)
    else:
        res = worker_hf(args.model_dir, cases, fw == "hf-static", args.prompt_len)
    report(res)


# Per-token cost vs cache slots (one compiled loop of decode steps) ---------------------------------
def slots_worker(slots: list[int], steps: int, vocab: int) -> list[dict]:
    """ms per decode step of the 6 x 384 model inside a compiled fori_loop, for each cache size:
    'generate' = what jaxgpt.inference.generate runs (unstacked layers, per-layer caches); 'stacked' = the
    public DecoderLM(cache=init_cache(...)) call with scanned layers and the (L, ...) cache."""
    import inspect

    import jax
    import jax.numpy as jnp

    from jaxgpt.config import ModelConfig
    from jaxgpt.models import decoder as dec
    from jaxgpt.models import init_params

    per_layer = "per_layer" in inspect.signature(dec.init_cache).parameters  # absent before the fix
    out = []
    for s in slots:
        cfg = ModelConfig(vocab_size=vocab, d_model=384, n_layer=6, n_head=6, max_len=s, pos="learned",
                          norm="layernorm", mlp="gelu", mlp_bias=True, qkv_bias=True, o_bias=True,
                          tie_embeddings=True)
        base = init_params(cfg, jax.random.PRNGKey(0))
        for mode in (("generate", "stacked") if per_layer else ("stacked",)):
            ex, p = dec.unstack_layers(cfg, base) if mode == "generate" else (None, base)  # ex: separate layers
            c, model = cfg, dec.DecoderLM(cfg) if ex is None else dec.DecoderLM(cfg, ex)

            def run(p, tok, c=c, model=model, mode=mode):
                cache = dec.init_cache(c, 1, s, per_layer=True) if mode == "generate" else dec.init_cache(c, 1, s)  # noqa: B023 - called in this iteration

                def step(i, st):
                    cache, tok = st
                    o = model.apply({"params": p}, tok[:, None], cache=cache)
                    return o.cache, jnp.argmax(o.logits[:, -1], -1).astype(jnp.int32)

                return jax.lax.fori_loop(0, steps, step, (cache, tok))[1]

            tok = jnp.zeros((1,), jnp.int32)
            compiled = jax.jit(run).lower(p, tok).compile()
            jax.block_until_ready(compiled(p, tok))
            ms = 1e3 * median_of(lambda: jax.block_until_ready(compiled(p, tok)), 5)  # noqa: B023 - called in this iteration
            cache_mb = 2 * 6 * s * 384 * 4 / 1e6
            out.append({"slots": s, "mode": mode, "ms_per_token": ms / steps, "cache_mb": cache_mb,
                            "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6})
    return out


# Parent ----------------------------------------------------------------------------------------------
FAMILIES = ("gpt2", "llama2", "llama3")


def build_model_dir(path: Path, vocab: int, d: int, layers: int, heads: int, ctx: int, family: str = "gpt2") -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=d, n_layer=layers,
                                   n_head=heads)).eval().save_pretrained(path)
        return
    rope = {"rope_type": "default", "rope_theta": 10000.0} if family == "llama2" else {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ctx // 4, "rope_theta": 500000.0}
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=-(-(8 * d // 3) // 8) * 8,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                 max_position_embeddings=ctx, rope_parameters=rope)).eval().save_pretrained(path)


def run_worker(argv: list[str]) -> list[dict]:
    return spawn("scripts.benchmarks.bench_decode", *argv, check=True)


def markdown(rows: list[dict], slots: list[dict]) -> str:
    out = ["| batch | new tokens | framework | tokens/s | ms/token | TTFT ms | vs jax cached | tokens match |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est = " (est.)" if r.get("estimated") else ""
        out.append(f"| {r['batch']} | {r['new']} | {r['framework']}{est} | {r['tok_s']:.0f} | {r['ms_token']:.2f} | "
                   f"{r['ttft'] * 1e3:.1f} | {r['speedup_of_jax_cached']:.2f}x | {r['tokens_match']} |")
    if slots:
        out += ["", "| cache slots | path | ms/token | cache MB | compiled temp MB |", "|---|---|---|---|---|"]
        out += [f"| {s['slots']} | {s['mode']} | {s['ms_per_token']:.2f} | {s['cache_mb']:.1f} | {s['temp_mb']:.1f} |"
                for s in slots]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: tiny model and shapes, one repeat")
    ap.add_argument("--slots", action="store_true", help="only the ms/token vs cache slots table")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", default="256,1008", help="1008 + the 16-token prompt fills the 1024 context")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--out", default=str(RESULTS / "engine" / "decode.json"))
    ap.add_argument("--family", choices=FAMILIES, default="gpt2", help="the model: GPT-2, or a LLaMA 2 / Llama 3 "
                    "(llama3 RoPE scaling) of the same shapes; not gpt2: no slots table, the output named decode_<family>")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--slot-sizes", default="256,1024,4096")
    ap.add_argument("--isa", choices=ISAS, default="native", help="cap torch, XLA and jaxgpt's kernels at this "
                    "instruction set in every worker (scripts/harness.py::isa_env)")
    args = ap.parse_args()
    os.environ.update(isa_env(args.isa))  # the workers inherit it
    if args.worker == "slots":
        print("RESULT " + json.dumps(slots_worker([int(s) for s in args.slot_sizes.split(",")], 32, 65)))
        return
    if args.worker:
        worker(args)
        return

    dims = {"vocab": 65, "d": 384, "layers": 6, "heads": 6, "ctx": 1024}
    batches, news = [int(x) for x in args.batches.split(",")], [int(x) for x in args.new_tokens.split(",")]
    if args.quick:
        dims, batches, news, args.repeats, args.prompt_len = {"vocab": 65, "d": 64, "layers": 2, "heads": 2, "ctx": 128}, [2], [32], 1, 8
        if args.frameworks == ",".join(FRAMEWORKS):
            args.frameworks = "jax-cached,jax-uncached,torch-cached,hf-default"
    load_before = os.popen("uptime").read().strip()
    slots = [] if (args.quick or args.family != "gpt2") and not args.slots else run_worker(["--worker", "slots", "--slot-sizes", args.slot_sizes])
    rows = []
    if not args.slots:
        cases = [(b, n) for b in batches for n in news]
        fws = args.frameworks.split(",")
        runs = {fw: [] for fw in fws}
        with tempfile.TemporaryDirectory() as tmp:
            build_model_dir(Path(tmp), **dims, family=args.family)
            for r in range(args.repeats):
                for fw in fws[r % len(fws):] + fws[:r % len(fws)]:  # rotate the order: A B C, B C A, ...
                    print(f"repeat {r + 1}/{args.repeats}: {fw}", file=sys.stderr, flush=True)
                    runs[fw].append(run_worker(["--worker", fw, "--model-dir", tmp, "--cases", json.dumps(cases),
                                                "--prompt-len", str(args.prompt_len)]))
        for i, (b, n) in enumerate(cases):
            ref = runs.get("jax-cached", [[None] * len(cases)])[0][i]
            ref_s = statistics.median(run[i]["seconds"] for run in runs["jax-cached"]) if "jax-cached" in runs else None
            for fw in fws:
                res = [run[i] for run in runs[fw]]
                sec = statistics.median(x["seconds"] for x in res)
                toks = res[0]["tokens"]
                match = None if ref is None else all(row == rref[:len(row)] for row, rref in zip(toks, ref["tokens"]))
                rows.append({"framework": fw, "batch": b, "new": n, "seconds": sec, "tok_s": b * n / sec, "ms_token": 1e3 * sec / n,
                                 "ttft": statistics.median(x["ttft"] for x in res), "estimated": res[0].get("estimated", False),
                                 "compile_s": res[0].get("compile_s"), "speedup_of_jax_cached": (sec / ref_s) if ref_s else float("nan"),
                                 "tokens_match": match, "repeats": len(res)})
    table = markdown(rows, slots)
    load_after = os.popen("uptime").read().strip()
    print(table)
    out = Path(args.out)
    if args.quick or args.slots or args.family != "gpt2":  # keep the full table's files
        out = out.with_name("decode_quick.json" if args.quick else "decode_slots.json" if args.slots
                            else f"decode_{args.family}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python -m scripts.benchmarks.bench_decode", *sys.argv[1:]]), "dims": dims,
                                   "family": args.family, "prompt_len": args.prompt_len, "rows": rows, "slots": slots, "cpu_count": os.cpu_count(),
                                   "isa": args.isa, "uptime_before": load_before, "uptime_after": load_after,
                                   "note": "machine shared with other jobs unless stated; medians of repeats"}, indent=1))
    out.with_suffix(".md").write_text(table + f"\n\nInstruction sets: {args.isa}. uptime before: `{load_before}`; "
                                      f"after: `{load_after}`.\n")
    bad = [r for r in rows if r["tokens_match"] is False]
    if bad:
        print(f"WARNING: greedy tokens differ from jax cached for {[(r['framework'], r['batch'], r['new']) for r in bad]}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
