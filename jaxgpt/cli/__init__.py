"""``jaxgpt train | sample | eval | prepare | convert | bench | parity | serve`` (also ``python -m jaxgpt``).

Expected failures (missing file, unknown preset, bad ``--set``, invalid config) print one line
on stderr and exit with 2; ``--debug`` shows the traceback instead. Heavy imports (JAX, orbax)
happen inside the commands, so argument errors are reported at once.

One module per command (train, sample, eval, prepare, convert, parity, bench, serve); ``common`` holds what they share.
"""
from __future__ import annotations

import argparse
import sys

from jaxgpt.cli.bench import cmd_bench
from jaxgpt.cli.common import USER_ERRORS
from jaxgpt.cli.convert import cmd_convert
from jaxgpt.cli.eval import cmd_eval
from jaxgpt.cli.parity import cmd_parity
from jaxgpt.cli.prepare import add_parser as add_prepare_parser
from jaxgpt.cli.sample import cmd_sample
from jaxgpt.cli.serve import add_parser as add_serve_parser
from jaxgpt.cli.train import cmd_train
from jaxgpt.config import PRESETS
from jaxgpt.parallel.host_devices import use_host_devices
from jaxgpt.cli import compile_cache


def _add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a preset on a text file or a built-in corpus")
    start = t.add_mutually_exclusive_group(required=True)
    start.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (training defaults: TrainConfig's, seed 000's; "
                       "gpt2-*: decay=matrices)")
    start.add_argument("--init", help="fine-tune these weights: jaxgpt checkpoint, .safetensors, .pt or HF model dir "
                       "(training defaults: TrainConfig's with decay=matrices and a warmup of 5%% of the steps, at most "
                       "100)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="UTF-8 text file, .tsv (src<TAB>tgt pairs; label<TAB>text for classifiers), or a "
                     "token directory (train.bin/val.bin + meta.json from jaxgpt prepare, or nanoGPT's + meta.pkl)")
    src.add_argument("--corpus", help="built-in corpus: seed-synthetic, zh-en")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="training (steps, lr, batch_size, ...) or model (d_model, n_layer, ...) setting; repeatable")
    t.add_argument("--epochs", type=int, help="train this many passes over the data (steps derived from it; "
                   "same as --set epochs=N; with --set lr_per_epoch=true the schedule steps once per epoch)")
    t.add_argument("--out", required=True, help="run directory; resumes when it holds a checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--log", action="append", choices=("tensorboard",), help="also write TensorBoard event files "
                   "to OUT/tensorboard (beside metrics.jsonl; no extra dependency)")
    t.add_argument("--check-data", action="store_true", help="token directory: check every id against the "
                   "vocabulary before training (default: a sample at open; each batch is checked as it is read)")
    t.add_argument("--mesh", help="device mesh, e.g. data=8 or data=2,fsdp=2,tensor=2 (an omitted axis is 1; "
                   "docs/scaling.md); on a CPU it sets the host device count")
    t.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: process 0's address (jax.distributed)")
    t.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    t.add_argument("--process-id", type=int, help="multi-host: this process's index, 0-based")
    t.set_defaults(fn=cmd_train)


def _add_sample_parser(sub) -> None:
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


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="validation loss, perplexity and accuracy of a checkpoint")
    e.add_argument("--ckpt", required=True)
    src = e.add_mutually_exclusive_group()
    src.add_argument("--data", help="default: the data the checkpoint was trained on")
    src.add_argument("--corpus")
    e.add_argument("--batches", type=int, help="validation batches (default: the run's eval_batches)")
    e.add_argument("--step", type=int)
    e.add_argument("--json", help="also write the result here")
    e.set_defaults(fn=cmd_eval)


def _add_convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="convert weights between jaxgpt, safetensors, torch_ref, HF and nanoGPT")
    c.add_argument("src", help="jaxgpt run/checkpoint dir, .safetensors, torch_ref or nanoGPT .pt, HF model dir")
    c.add_argument("dst")
    c.add_argument("--to", choices=("jaxgpt", "safetensors", "torch", "hf"),
                   help="output format (default from dst: .safetensors, .pt, else a jaxgpt checkpoint dir)")
    c.add_argument("--from", dest="src_format", choices=("jaxgpt", "safetensors", "torch", "hf"))
    c.set_defaults(fn=cmd_convert)


def _add_bench_parser(sub) -> None:
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


def _add_parity_parser(sub) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train_parser, _add_sample_parser, _add_eval_parser, add_prepare_parser, _add_convert_parser,
                _add_bench_parser, _add_parity_parser, add_serve_parser):  # the order `jaxgpt --help` lists
        add(sub)
    return p


# commands that compile models: they load compiled programs from the persistent cache (cli/compile_cache.py)
COMPILING = ("train", "sample", "eval", "serve", "bench", "parity")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in COMPILING:
            use_host_devices()  # before JAX starts: one CPU device per core (jaxgpt.parallel.host_devices)
            compile_cache.enable()
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
