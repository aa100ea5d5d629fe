"""``jaxgpt train | sample | eval | convert | bench | parity`` (also ``python -m jaxgpt``).

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

# FloatingPointError: training met a NaN/inf loss (jaxgpt.train.loop.NonFiniteLoss).
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               FloatingPointError)


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


def _as_field(cls, name: str, raw: str, value):
    """A string field keeps the text as typed ('none' is a value of ``pos``, '1' could be a name)."""
    return raw if cls.field_types()[name] == (str,) else value


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
            train[key] = _as_field(TrainConfig, key, raw, value)
            continue
        target, _, name = key.rpartition(".")
        if name in model_fields:
            value = _as_field(ModelConfig, name, raw, value)
        elif name in own:
            value = _as_field(type(config), name, raw, value)
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

def _train_sets(args) -> list[str]:
    """``--set`` values, plus ``--epochs N`` as ``epochs=N``."""
    return args.set + ([f"epochs={args.epochs}"] if args.epochs else [])


def _init_from(args, **train_sets):
    """``train --init SRC``: fine-tune the weights of a jaxgpt checkpoint, .safetensors, .pt or HF
    directory with its own tokenizer. Returns what ``prepare`` does; a rerun resumes as usual.
    ``train_sets``: TrainConfig fields set by flags (``--mesh``)."""
    import jax

    from jaxgpt.config import ModelConfig
    from jaxgpt.models import abstract_params
    from jaxgpt.convert.files import detect_format, load_weights
    from jaxgpt.train.loop import prepare
    from jaxgpt.train.step import init_state
    from jaxgpt.train.tasks import fit_config, load_task, with_epochs

    fmt = detect_format(args.init)
    config, params, extras = _load_hf_dir(args.init) if fmt == "hf" else load_weights(args.init, fmt)
    config, tc = apply_sets(config, _train_sets(args))
    tc = tc.replace(**train_sets)
    shapes = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)  # noqa: E731
    if shapes(abstract_params(config)) != shapes(params):
        raise ValueError(f"--set changes the shapes of {args.init}'s parameters; only shape-free settings "
                         "(dropout, training keys) apply to --init")
    if (Path(args.out) / "checkpoints").is_dir():
        from jaxgpt.train.checkpoint import Checkpoints

        ckpts = Checkpoints(args.out, create=False)
        saved = ckpts.latest_step() is not None
        ckpts.close()
        if saved:  # resume the fine-tuning run exactly
            return prepare(args.out, config, tc, data=args.data, corpus=args.corpus)
    tok = extras.get("tokenizer")
    if tok is None:
        raise ValueError(f"{args.init} has no tokenizer (imported weights without tokenizer.json): "
                         "it cannot encode the training data")
    if tok.get("kind") == "hf" and not isinstance(config, ModelConfig):
        raise ValueError(f"{args.init}: fine-tuning from an HF directory supports decoder LMs (GPT-2, LLaMA), "
                         f"not {type(config).__name__}")
    task = load_task(config, tc, data=args.data, corpus=args.corpus, tokenizer=tok)
    fitted = fit_config(config, task)
    if fitted != config:
        have = config.to_dict()
        diffs = [f"{k}={v!r} (the weights have {have[k]!r})" for k, v in fitted.to_dict().items() if have[k] != v]
        raise ValueError(f"{args.init} does not fit this data: it needs {', '.join(diffs)}")
    tc = with_epochs(tc, task)
    return config, tc, task, init_state(config, tc, params)


def _start_devices(args) -> None:
    """Before JAX starts: join a multi-host run (jax.distributed), or, on one host, give the CPU as
    many host devices as ``--mesh`` needs (also a CPU speed lever: the batch split over both cores)."""
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multi):
        if any(v is None for v in multi):
            raise ValueError("multi-host training needs --coordinator HOST:PORT, --num-processes N and "
                             f"--process-id I together; got {args.coordinator!r}, {args.num_processes!r}, "
                             f"{args.process_id!r}")
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
        import jax

        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    elif args.mesh:
        from jaxgpt.sharding import mesh_devices, use_host_devices

        use_host_devices(mesh_devices(args.mesh))  # CPU only; a GPU/TPU host keeps its own device count


def cmd_train(args) -> int:
    from jaxgpt.models import count_params
    from jaxgpt.models import abstract_params
    from jaxgpt.train.loop import fit, prepare

    _start_devices(args)
    mesh = {"mesh": args.mesh} if args.mesh else {}
    if args.init:
        config, tc, task, state = _init_from(args, **mesh)
    else:
        config, tc = apply_sets(get_preset(args.preset), _train_sets(args))
        config, tc, task, state = prepare(args.out, config, tc.replace(**mesh), data=args.data, corpus=args.corpus)
    n = count_params(abstract_params(config))
    where = f"resuming at step {int(state.step)}" if state is not None and int(state.step) else (
        f"from {args.init}" if args.init else "from scratch")
    print(f"{args.preset or args.init}: {n:,} parameters | {task.kind} on {task.source} | vocab {task.tokenizer.vocab_size} | "
          f"{tc.steps} steps of {tc.batch_size}x{tc.seq_len} | {where} | out {args.out}", flush=True)
    summary = fit(config, tc, task, args.out, state=state, progress=not args.quiet)
    val = "none (val_fraction=0)" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}"
    print(f"done: final loss {summary['final_loss']:.4f} (mean of the last 20 steps), val loss "
          f"{val}, {summary['tok_s'] or 0:,.0f} tok/s | {args.out}/metrics.jsonl"
          + (f", {summary['plot']}" if summary["plot"] else "")
          + (f" | skipped {summary['skipped']} updates with a non-finite loss" if summary.get("skipped") else ""))
    return 0


def _load_hf_dir(path: str) -> tuple[object, dict, dict]:
    """(config, params, extras) of a Hugging Face model directory, its tokenizer.json included."""
    from jaxgpt.convert.files import load_weights
    from jaxgpt.hf_tokenizer import tokenizer_dict

    config, params, extras = load_weights(path, "hf")
    return config, params, {**extras, "tokenizer": extras.get("tokenizer") or tokenizer_dict(path),
                            "source": f"hf:{path}"}


def _is_hf_dir(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not (p / "checkpoints").is_dir()


def _load_for_inference(ckpt: str, step: int | None):
    """A jaxgpt run/checkpoint directory or a Hugging Face model directory -> (config, params, meta, tokenizer)."""
    from jaxgpt.data import tokenizer_from_dict
    from jaxgpt.train.checkpoint import Checkpoints

    if _is_hf_dir(ckpt):
        if step is not None:
            raise ValueError(f"--step {step}: {ckpt} is a Hugging Face directory, which holds one set of weights")
        config, params, meta = _load_hf_dir(ckpt)
    else:
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
            eos = tok.eos_id if kind == "pairs" or getattr(tok, "kind", None) == "hf" else None
            out = np.asarray(generate(config, params, np.repeat(prompt[None], args.num_samples, 0),
                                      args.max_new_tokens, eos_id=eos, **kw))
            if tok is None:
                texts = [",".join(map(str, row)) for row in out]
            elif kind == "pairs":
                texts = [tok.decode_en(row) for row in out]
            elif eos is not None:  # HF: up to and including the first EOS, as transformers' generate stops
                n = len(prompt)
                texts = [tok.decode(row[:n + (list(row[n:]).index(eos) + 1 if eos in row[n:] else len(row))])
                         for row in out]
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
    if "train" not in meta and args.data is None and args.corpus is None:
        raise ValueError(f"{args.ckpt} records no training data (a Hugging Face directory): pass --data FILE "
                         "or --corpus NAME")
    if meta.get("tokenizer") is None:
        raise ValueError(f"{args.ckpt} has no tokenizer (no tokenizer.json): it cannot encode --data")
    tc = TrainConfig.from_dict(meta["train"]) if "train" in meta else TrainConfig()
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
    if src_fmt == "hf":
        config, params, extras = _load_hf_dir(args.src)
    else:
        config, params, extras = load_weights(args.src, src_fmt)
    save_weights(args.dst, dst_fmt, config, params, {**extras, "source": str(args.src)})
    print(f"{args.src} ({src_fmt}) -> {args.dst} ({dst_fmt}): {type(config).__name__}")
    return 0


def cmd_parity(args) -> int:
    from jaxgpt.parity import format_table, run, write_json

    report = run(args.model, prompt=args.prompt, batch=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                 dtype=args.dtype, tol=args.tol, grads=args.grads, generate=args.generate)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if report["ok"] else 1


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
    start = t.add_mutually_exclusive_group(required=True)
    start.add_argument("--preset", help=f"one of: {', '.join(PRESETS)}")
    start.add_argument("--init", help="fine-tune these weights: jaxgpt checkpoint, .safetensors, .pt or HF model dir")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="UTF-8 text file, or .tsv (src<TAB>tgt pairs; label<TAB>text for classifiers)")
    src.add_argument("--corpus", help="built-in corpus: seed-synthetic, zh-en")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="training (steps, lr, batch_size, ...) or model (d_model, n_layer, ...) setting; repeatable")
    t.add_argument("--epochs", type=int, help="train this many passes over the data (steps derived from it; "
                   "same as --set epochs=N; with --set lr_per_epoch=true the schedule steps once per epoch)")
    t.add_argument("--out", required=True, help="run directory; resumes when it holds a checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--mesh", help="device mesh, e.g. data=8 or data=2,fsdp=2,tensor=2 (an omitted axis is 1; "
                   "docs/scaling.md); on a CPU it sets the host device count")
    t.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: process 0's address (jax.distributed)")
    t.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    t.add_argument("--process-id", type=int, help="multi-host: this process's index, 0-based")
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

    q = sub.add_parser("parity", help="compare a torch checkpoint with its jaxgpt conversion, layer by layer "
                                      "(exit 1 when anything exceeds --tol)")
    q.add_argument("model", help="HF model directory, nanoGPT ckpt.pt or torch_ref .pt (from jaxgpt convert)")
    q.add_argument("--prompt", help="text to run (needs the directory's tokenizer.json); default: random ids")
    q.add_argument("--batch-size", type=int, default=2)
    q.add_argument("--seq-len", type=int, default=16)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    q.add_argument("--tol", type=float, help="max error / max(1, max|torch|) (default 1e-5; bfloat16 5e-2)")
    q.add_argument("--grads", action="store_true", help="also every parameter's loss gradient and one AdamW step")
    q.add_argument("--generate", type=int, default=8, metavar="N", help="greedy tokens to compare (0: skip)")
    q.add_argument("--json", help="also write the full report here")
    q.set_defaults(fn=cmd_parity)
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
