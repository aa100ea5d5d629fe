"""``jaxgpt train``: train a preset (or fine-tune --init weights) on text, pairs or a corpus."""
from __future__ import annotations

from jaxgpt.cli.common import init_from, run_defaults, start_devices, train_sets
from jaxgpt.config import apply_sets, get_preset, train_defaults
from jaxgpt.config.overrides import parse_sets


def _check_token_dir(args) -> None:
    """A token directory: its metadata must agree with ``--set vocab_size``; ``--check-data`` checks
    every id now (streamed), before any compilation."""
    from jaxgpt.data.tokenfiles import is_token_dir, open_tokens, read_meta

    if args.data is None or not is_token_dir(args.data):
        if getattr(args, "check_data", False):
            raise ValueError("--check-data checks a token directory; --data is not one")
        return
    meta = read_meta(args.data)
    sets = dict(parse_sets(args.set))
    if "vocab_size" in sets and meta["vocab_size"] is not None and int(sets["vocab_size"]) < meta["vocab_size"]:
        raise ValueError(f"--set vocab_size={sets['vocab_size']} is smaller than {args.data}'s vocabulary "
                         f"(vocab_size={meta['vocab_size']}); drop the --set (the vocabulary comes from the data), "
                         "or pad it: a larger vocab_size")
    if getattr(args, "check_data", False):
        vocab = int(sets["vocab_size"]) if "vocab_size" in sets else \
            getattr(get_preset(args.preset), "vocab_size", None) if args.preset else None  # meta-less nanoGPT files
        open_tokens(args.data, vocab_size=vocab, check="full")


def cmd_train(args) -> int:
    from jaxgpt.models import count_params
    from jaxgpt.models import abstract_params
    from jaxgpt.train.loop import fit, prepare

    start_devices(args)
    _check_token_dir(args)
    mesh = {"mesh": args.mesh} if args.mesh else {}
    if args.init:
        config, tc, task, state = init_from(args, **mesh)
    else:
        config, tc = apply_sets(get_preset(args.preset), train_sets(args),
                                run_defaults(args.out, train_defaults(args.preset)))
        # --set vocab_size=N: a padded table of N rows (nanoGPT's 50304); else the data's vocabulary
        padded = config.vocab_size if "vocab_size" in dict(parse_sets(args.set)) else None
        config, tc, task, state = prepare(args.out, config, tc.replace(**mesh), data=args.data, corpus=args.corpus,
                                          vocab_size=padded)
    n = count_params(abstract_params(config))
    where = f"resuming at step {int(state.step)}" if state is not None and int(state.step) else (
        f"from {args.init}" if args.init else "from scratch")
    print(f"{args.preset or args.init}: {n:,} parameters | {task.kind} on {task.source} | vocab {task.tokenizer.vocab_size} | "
          f"{tc.steps} steps of {tc.batch_size}x{tc.seq_len} | {where} | out {args.out}", flush=True)
    loggers = []
    if "tensorboard" in (getattr(args, "log", None) or []):
        from jaxgpt.parallel.hosts import is_primary
        from jaxgpt.train.tensorboard import TensorBoardLog

        if is_primary():
            loggers.append(TensorBoardLog(f"{args.out}/tensorboard"))
    try:
        summary = fit(config, tc, task, args.out, state=state, progress=not args.quiet, loggers=tuple(loggers))
    finally:
        for logger in loggers:
            logger.close()
    val = "none (val_fraction=0)" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}"
    print(f"done: final loss {summary['final_loss']:.4f} (mean of the last 20 steps), val loss "
          f"{val}, {summary['tok_s'] or 0:,.0f} tok/s | {args.out}/metrics.jsonl"
          + (f", {summary['plot']}" if summary["plot"] else "")
          + (f" | skipped {summary['skipped']} updates with a non-finite loss" if summary.get("skipped") else ""))
    return 0
