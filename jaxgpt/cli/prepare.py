"""``jaxgpt prepare SRC... OUT --tokenizer char|HF_DIR|tokenizer.json``: documents -> token files."""
from __future__ import annotations


def cmd_prepare(args) -> int:
    from jaxgpt.data.prepare import prepare

    prepare(args.src, args.out, args.tokenizer, text_field=args.text_field, text_unit=args.text_unit,
            split=args.split, val_fraction=args.val_fraction, min_val_tokens=args.min_val_tokens, num_proc=args.num_proc, eos=args.eos,
            merge=not args.keep_shards, progress=not args.quiet)
    return 0


def add_parser(sub) -> None:
    from jaxgpt.data.prepare import MIN_VAL_TOKENS, TEXT_UNITS

    p = sub.add_parser("prepare", help="tokenize text / jsonl / parquet / a saved datasets dataset into token "
                                       "files (train.bin, val.bin, meta.json) for train --data DIR")
    p.add_argument("src", nargs="+", help="text files or globs, .jsonl, .parquet, or a datasets save_to_disk directory")
    p.add_argument("out", help="output directory (a rerun skips the shards already finished)")
    p.add_argument("--tokenizer", default="char", help="'char', an HF directory with tokenizer.json, or a tokenizer.json")
    p.add_argument("--text-field", default="text", help="jsonl / parquet / datasets: the text column (default text)")
    p.add_argument("--text-unit", choices=TEXT_UNITS, default="file",
                   help="text files: a document per file (default), per blank-line paragraph, or per line")
    p.add_argument("--split", default="train", help="a saved DatasetDict: the split to read (default train)")
    p.add_argument("--val-fraction", type=float, default=0.0005, help="the fraction of documents held out for "
                   "val.bin (default 0.0005; 0: no validation split)")
    p.add_argument("--min-val-tokens", type=int, default=MIN_VAL_TOKENS, help="when the held-out documents have "
                   "fewer tokens, val.bin takes the end of the training stream up to this many, at most a tenth of "
                   f"the corpus (default {MIN_VAL_TOKENS}: a small corpus still gets a validation split; 0: never)")
    p.add_argument("--num-proc", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--eos", help="the document separator token (default: the tokenizer's EOS or <|endoftext|>)")
    p.add_argument("--keep-shards", action="store_true", help="list the shard files in meta.json instead of "
                   "concatenating them into train.bin / val.bin (no second copy on disk)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_prepare)
