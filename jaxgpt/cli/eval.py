"""``jaxgpt eval``: validation loss, perplexity and accuracy of a checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from jaxgpt.cli.common import load_for_inference
from jaxgpt.config import TrainConfig

def cmd_eval(args) -> int:
    from jaxgpt.train.loop import evaluate
    from jaxgpt.data.tasks import load_task

    config, params, meta, _ = load_for_inference(args.ckpt, args.step)
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
    from jaxgpt.data.tokenfiles import is_token_dir

    if data is not None and is_token_dir(data):  # validation from val.bin, whatever the run's val_fraction
        from jaxgpt.data.token_task import token_task

        task = token_task(data, tc, vocab_size=config.vocab_size, tokenizer=meta["tokenizer"], need_val=True)
    else:
        task = load_task(config, tc, data=data, corpus=corpus, tokenizer=meta["tokenizer"])
    batches = task.eval_batches(tc)
    if not batches:
        raise ValueError(f"{task.source} has no validation split (trained with val_fraction=0): pass --data or --corpus "
                         "with validation data")
    result = evaluate(config, params, batches)
    metric = "accuracy" if task.kind == "classify" else "token accuracy"
    print(f"{task.source} (validation split, {len(batches)} batches): loss {result['val_loss']:.4f} "
          f"| perplexity {result['val_ppl']:.3f} | {metric} {result['val_accuracy']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
