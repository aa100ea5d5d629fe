"""``jaxgpt train``: train a preset (or fine-tune --init weights) on text, pairs or a corpus."""
from __future__ import annotations

from jaxgpt.cli.common import _init_from, _start_devices, _train_sets
from jaxgpt.config import apply_sets, get_preset

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
