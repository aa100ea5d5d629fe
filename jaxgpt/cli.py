"""``jaxgpt train | sample | eval | convert | bench`` (also ``python -m jaxgpt``).

Expected failures (missing file, unknown preset, bad ``--set``, invalid config) print one line
on stderr and exit with 2; ``--debug`` shows the traceback instead. Heavy imports (JAX, orbax)
happen inside the commands, so argument errors are reported at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jaxgpt.config import PRESETS, EncDecConfig, ModelConfig, TrainConfig, get_preset

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def parse_value(text: str):
    """'3' -> 3, '1e-3' -> 0.001, 'true'/'false'/'none' -> bool/None, anything else -> the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def apply_sets(config, items: list[str]) -> tuple[object, TrainConfig]:
    """``key=value`` settings -> (model config, TrainConfig). Training keys go to TrainConfig;
    model keys to the config (BERT: its own fields or the encoder's; encoder-decoder: both
    stacks, or one with an ``encoder.``/``decoder.`` prefix)."""
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    own = {f.name for f in dataclasses.fields(config)} - {"encoder", "decoder"}
    train: dict = {}
    model: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        value = parse_value(raw)
        if key in train_fields:
            train[key] = value
            continue
        target, _, name = key.rpartition(".")
        if isinstance(config, ModelConfig) and not target and name in model_fields:
            model.setdefault("", {})[name] = value
        elif not isinstance(config, ModelConfig) and not target and name in own:
            model.setdefault("self", {})[name] = value
        elif not isinstance(config, ModelConfig) and name in model_fields and target in ("", "encoder", "decoder"):
            stacks = [target] if target else ["encoder"] + (["decoder"] if isinstance(config, EncDecConfig) else [])
            if target == "decoder" and not isinstance(config, EncDecConfig):
                raise ValueError(f"{key!r}: a {type(config).__name__} has no decoder")
            for stack in stacks:
                model.setdefault(stack, {})[name] = value
        else:
            raise ValueError(f"unknown setting {key!r}; training keys: {', '.join(sorted(train_fields))}; "
                             f"model keys: {', '.join(sorted(model_fields | own))}")
    if "" in model:
        config = config.replace(**model[""])
    nested = {stack: getattr(config, stack).replace(**model[stack]) for stack in ("encoder", "decoder") if stack in model}
    if nested or "self" in model:
        config = config.replace(**nested, **model.get("self", {}))
    return config, TrainConfig(**train)


# --- commands ---------------------------------------------------------------------------------

def cmd_train(args) -> int:
    from jaxgpt.models.bert import count_params
    from jaxgpt.convert.external import abstract_params
    from jaxgpt.train.loop import fit, prepare

    config, tc = apply_sets(get_preset(args.preset), args.set)
    config, tc, task, state = prepare(args.out, config, tc, data=args.data, corpus=args.corpus)
    n = count_params(abstract_params(config))
    where = f"resuming at step {int(state.step)}" if state is not None else "from scratch"
    print(f"{args.preset}: {n:,} parameters | {task.kind} on {task.source} | vocab {task.tokenizer.vocab_size} | "
          f"{tc.steps} steps of {tc.batch_size}x{tc.seq_len} | {where} | out {args.out}", flush=True)
    summary = fit(config, tc, task, args.out, state=state, progress=not args.quiet)
    print(f"done: final loss {summary['final_loss']:.4f} (mean of the last 20 steps), val loss "
          f"{summary['val_loss']:.4f}, {summary['tok_s'] or 0:,.0f} tok/s | {args.out}/metrics.jsonl"
          + (f", {summary['plot']}" if summary["plot"] else ""))
    return 0


def _load_for_inference(ckpt: str, step: int | None):
    from jaxgpt.data import tokenizer_from_dict
    from jaxgpt.train.checkpoint import Checkpoints

    config, params, meta = Checkpoints(ckpt, create=False).restore_params(step)
    tok = tokenizer_from_dict(meta["tokenizer"]) if meta.get("tokenizer") else None
    return config, params, meta, tok


def cmd_sample(args) -> int:
    import jax
    import numpy as np

    from jaxgpt.generate import generate, generate_seq2seq

    config, params, meta, tok = _load_for_inference(args.ckpt, args.step)
    kind = meta.get("kind", "lm")
    if kind == "classify":
        raise ValueError(f"{args.ckpt} holds a classifier; use `jaxgpt eval` for its accuracy")
    if args.prompt_ids is not None:
        prompt = np.asarray([int(i) for i in args.prompt_ids.split(",")], np.int32)
    elif tok is None:
        raise ValueError(f"{args.ckpt} has no tokenizer (imported weights): pass --prompt-ids 1,2,3")
    else:
        prompt = tok.prompt(args.prompt) if kind in ("pairs",) else tok.encode(args.prompt)
    for t in args.temperature:
        rng = jax.random.PRNGKey(args.seed)
        kw = dict(temperature=t, top_k=args.top_k, top_p=args.top_p, rng=rng)
        if kind == "seq2seq":
            src = np.repeat(prompt[None], args.num_samples, 0)
            out = np.asarray(generate_seq2seq(config, params, src, np.ones_like(src, bool), args.max_new_tokens,
                                              bos_id=tok.bos_id, eos_id=tok.eos_id, **kw))
            texts = [tok.decode_en([tok.sep_id, *row]) for row in out]
        else:
            eos = tok.eos_id if kind == "pairs" else None
            out = np.asarray(generate(config, params, np.repeat(prompt[None], args.num_samples, 0),
                                      args.max_new_tokens, eos_id=eos, **kw))
            if tok is None:
                texts = [",".join(map(str, row)) for row in out]
            elif kind == "pairs":
                texts = [tok.decode_en(row) for row in out]
            else:
                texts = [tok.decode(row) for row in out]
        label = "greedy" if t == 0 else f"temperature {t}"
        for text in texts:
            print(f"--- {label} ---\n{text}")
    return 0


def cmd_eval(args) -> int:
    from jaxgpt.train.loop import evaluate
    from jaxgpt.train.tasks import load_task

    config, params, meta, _ = _load_for_inference(args.ckpt, args.step)
    tc = TrainConfig.from_dict(meta["train"])
    if args.batches:
        tc = tc.replace(eval_batches=args.batches)
    data, corpus = args.data, args.corpus
    if data is None and corpus is None:  # the data it was trained on
        source = meta.get("source", "")
        corpus, data = (source.removeprefix("corpus:"), None) if source.startswith("corpus:") else (None, source)
    task = load_task(config, tc, data=data, corpus=corpus, tokenizer=meta["tokenizer"])
    batches = task.eval_batches(tc)
    result = evaluate(config, params, batches)
    metric = "accuracy" if task.kind == "classify" else "token accuracy"
    print(f"{task.source} (validation split, {len(batches)} batches): loss {result['val_loss']:.4f} "
          f"| perplexity {result['val_ppl']:.3f} | {metric} {result['val_accuracy']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cmd_convert(args) -> int:
    from jaxgpt.convert.files import detect_format, load_weights, save_weights

    src_fmt = args.src_format or detect_format(args.src)
    dst_fmt = args.to or {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}.get(Path(args.dst).suffix,
                                                                                            "jaxgpt")
    config, params, extras = load_weights(args.src, src_fmt)
    save_weights(args.dst, dst_fmt, config, params, {**extras, "source": str(args.src)})
    print(f"{args.src} ({src_fmt}) -> {args.dst} ({dst_fmt}): {type(config).__name__}")
    return 0


def cmd_bench(args) -> int:
    from jaxgpt.bench import bench, format_table

    config, _ = apply_sets(get_preset(args.preset), args.set)
    result = bench(config, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                   new_tokens=args.new_tokens, torch=args.torch)
    result["preset"] = args.preset
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# --- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a preset on a text file or a built-in corpus")
    t.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="UTF-8 text file, or .tsv (src<TAB>tgt pairs; label<TAB>text for classifiers)")
    src.add_argument("--corpus", help="built-in corpus: seed-synthetic, zh-en")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="training (steps, lr, batch_size, ...) or model (d_model, n_layer, ...) setting; repeatable")
    t.add_argument("--out", required=True, help="run directory; resumes when it holds a checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sample", help="generate text from a checkpoint")
    s.add_argument("--ckpt", required=True)
    s.add_argument("--prompt", default="")
    s.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    s.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="one or more; 0 = greedy")
    s.add_argument("--top-k", type=int)
    s.add_argument("--top-p", type=float)
    s.add_argument("--max-new-tokens", type=int, default=100)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    s.set_defaults(fn=cmd_sample)

    e = sub.add_parser("eval", help="validation loss, perplexity and accuracy of a checkpoint")
    e.add_argument("--ckpt", required=True)
    src = e.add_mutually_exclusive_group()
    src.add_argument("--data", help="default: the data the checkpoint was trained on")
    src.add_argument("--corpus")
    e.add_argument("--batches", type=int, help="validation batches (default: the run's eval_batches)")
    e.add_argument("--step", type=int)
    e.add_argument("--json", help="also write the result here")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("convert", help="convert weights between jaxgpt, safetensors, torch_ref, HF and nanoGPT")
    c.add_argument("src", help="jaxgpt run/checkpoint dir, .safetensors, torch_ref or nanoGPT .pt, HF model dir")
    c.add_argument("dst")
    c.add_argument("--to", choices=("jaxgpt", "safetensors", "torch", "hf"),
                   help="output format (default from dst: .safetensors, .pt, else a jaxgpt checkpoint dir)")
    c.add_argument("--from", dest="src_format", choices=("jaxgpt", "safetensors", "torch", "hf"))
    c.set_defaults(fn=cmd_convert)

    b = sub.add_parser("bench", help="train-step and decode tokens/s for a preset")
    b.add_argument("--preset", required=True)
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model settings")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--seq-len", type=int)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--torch", action="store_true", help="also time torch_ref on the same machine")
    b.add_argument("--json", help="write the results as JSON here")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"jaxgpt {args.command}: interrupted (a train run saved a checkpoint; rerun to resume)", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"jaxgpt {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not a usage error: say so, keep it to one line
        if args.debug:
            raise
        print(f"jaxgpt {args.command}: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
