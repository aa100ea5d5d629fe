"""``jaxgpt parity``: a torch checkpoint against its jaxgpt conversion, layer by layer."""
from __future__ import annotations



def cmd_parity(args) -> int:
    from jaxgpt.tools.parity import format_table, run, write_json

    report = run(args.model, prompt=args.prompt, batch=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                 dtype=args.dtype, tol=args.tol, grads=args.grads, generate=args.generate)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if report["ok"] else 1
