"""``jaxgpt convert``: weights between jaxgpt, safetensors, torch_ref, HF and nanoGPT."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path


def cmd_convert(args) -> int:
    from jaxgpt.convert.files import detect_format, load_weights, save_weights

    src_fmt = args.src_format or detect_format(args.src)
    dst_fmt = args.to or {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}.get(Path(args.dst).suffix,
                                                                                            "jaxgpt")
    config, params, extras = load_weights(args.src, src_fmt)
    with warnings.catch_warnings(record=True) as caught:  # what the output cannot hold: one line each
        warnings.simplefilter("always")
        save_weights(args.dst, dst_fmt, config, params, {**extras, "source": str(args.src)})
    for w in caught:
        print(f"jaxgpt convert: warning: {' '.join(str(w.message).split())}", file=sys.stderr, flush=True)
    print(f"{args.src} ({src_fmt}) -> {args.dst} ({dst_fmt}): {type(config).__name__}")
    return 0
