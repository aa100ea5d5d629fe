"""``jaxgpt bench``: train-step and decode tokens/s for a preset."""
from __future__ import annotations

import json
from pathlib import Path

from jaxgpt.config import apply_sets, get_preset

def cmd_bench(args) -> int:
    from jaxgpt.tools.bench import bench, format_table

    config, tc = apply_sets(get_preset(args.preset), args.set)  # exec.* settings: tc.execution
    result = bench(config, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                   new_tokens=args.new_tokens, torch=args.torch, execution=tc.execution)
    result["preset"] = args.preset
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
