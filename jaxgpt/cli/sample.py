"""``jaxgpt sample``: generate from a checkpoint or an HF directory."""
from __future__ import annotations

from jaxgpt.cli.common import load_for_inference

def cmd_sample(args) -> int:
    import jax
    import numpy as np

    from jaxgpt.inference.generate import generate, generate_seq2seq

    config, params, meta, tok = load_for_inference(args.ckpt, args.step)
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
