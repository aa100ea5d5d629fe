"""``jaxgpt convert``: weights between jaxgpt, safetensors, torch_ref, HF and nanoGPT."""
from __future__ import annotations

from pathlib import Path

from jaxgpt.cli.common import load_hf_dir

def cmd_convert(args) -> int:
    from jaxgpt.convert.files import detect_format, load_weights, save_weights

    src_fmt = args.src_format or detect_format(args.src)
    dst_fmt = args.to or {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}.get(Path(args.dst).suffix,
                                                                                            "jaxgpt")
    if src_fmt == "hf":
        config, params, extras = load_hf_dir(args.src)
    else:
        config, params, extras = load_weights(args.src, src_fmt)
    save_weights(args.dst, dst_fmt, config, params, {**extras, "source": str(args.src)})
    print(f"{args.src} ({src_fmt}) -> {args.dst} ({dst_fmt}): {type(config).__name__}")
    return 0
