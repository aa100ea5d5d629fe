"""nanoGPT's ``train.py`` loop, restated for the real-run benchmark (bench_nanogpt_run) where only
nanoGPT's ``model.py`` is at hand (``../shared/reference/nanogpt``; the checkout's train.py is not
shipped here). One process, CPU, no DDP, no torch.compile, float32 (``train.py`` on a CPU runs under
``nullcontext`` and its GradScaler is disabled there), the same operations in the same order:

- ``get_batch``: ``torch.randint`` offsets into the uint16 memmaps, int64 rows stacked;
- every ``eval_interval`` steps, ``estimate_loss`` over ``eval_iters`` train then val batches (eval
  mode, no grad), and a ``torch.save`` of model + optimizer + ``model_args`` to ``ckpt.pt`` when the
  val loss improves (after step 0); also, not in train.py, the model of the last evaluation (after
  max_iters updates: the one whose loss is reported) to ``final.pt``, for scoring on a fixed split;
- the step: forward, the next batch fetched, backward, clip_grad_norm_ 1.0, AdamW
  (``configure_optimizers``: decay on >= 2-D params), zero_grad(set_to_none=True);
- ``loss.item()`` every ``log_interval`` steps; iterations 0..max_iters (max_iters + 1 updates);
- the warmup + cosine lr of ``get_lr``.

The seed is ``torch.manual_seed(1337 + seed)``: train.py's 1337 at ``--seed 0``. At seed 0 the final
validation loss equals the checkout's (1.8857 in results/engine/archive/nanogpt_run_final.md), which checks
that the restatement makes the same random draws in the same order.

    python -m scripts.benchmarks.nanogpt_train_loop --nanogpt DIR --data DIR --out DIR [--seed S]
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

# train.py's config/train_shakespeare_char.py with the README's CPU overrides (bench_nanogpt_run.NANOGPT_ARGS)
CONFIG = dict(eval_interval=250, eval_iters=20, log_interval=1, batch_size=12, block_size=64, n_layer=4, n_head=4,
              n_embd=128, dropout=0.0, bias=False, learning_rate=1e-3, max_iters=2000, lr_decay_iters=2000,
              min_lr=1e-4, warmup_iters=100, weight_decay=1e-1, beta1=0.9, beta2=0.99, grad_clip=1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", required=True, type=Path, help="the folder of nanoGPT's model.py")
    ap.add_argument("--data", required=True, type=Path, help="train.bin, val.bin, meta.pkl (nanoGPT's prepare.py)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed(1337 + seed)")
    a = ap.parse_args(argv)
    c = CONFIG
    sys.path.insert(0, str(a.nanogpt))
    import torch
    from model import GPT, GPTConfig  # nanoGPT's

    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1337 + a.seed)
    vocab = pickle.loads((a.data / "meta.pkl").read_bytes())["vocab_size"]

    def get_batch(split):
        data = np.memmap(a.data / f"{split}.bin", dtype=np.uint16, mode="r")  # train.py re-opens it every batch
        ix = torch.randint(len(data) - c["block_size"], (c["batch_size"],))
        x = torch.stack([torch.from_numpy(data[i:i + c["block_size"]].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + c["block_size"]].astype(np.int64)) for i in ix])
        return x, y

    model_args = dict(n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], block_size=c["block_size"],
                      bias=c["bias"], vocab_size=vocab, dropout=c["dropout"])
    model = GPT(GPTConfig(**model_args))
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]), "cpu")

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(c["eval_iters"])
            for k in range(c["eval_iters"]):
                x, y = get_batch(split)
                _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < c["warmup_iters"]:
            return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
        if it > c["lr_decay_iters"]:
            return c["min_lr"]
        ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
        return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])

    x, y = get_batch("train")
    t0, iter_num, local_iter_num, best_val, running_mfu = time.time(), 0, 0, 1e9, -1.0
    while True:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % c["eval_interval"] == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            if losses["val"] < best_val:
                best_val = losses["val"]
                if iter_num > 0:
                    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), model_args=model_args,
                                    iter_num=iter_num, best_val_loss=best_val, config=c), os.path.join(a.out, "ckpt.pt"))
            if iter_num == c["max_iters"]:  # the model the last estimate scored (max_iters updates), whatever its loss
                torch.save(dict(model=model.state_dict(), model_args=model_args, iter_num=iter_num, config=c),
                           os.path.join(a.out, "final.pt"))
        _, loss = model(x, y)
        x, y = get_batch("train")  # the next batch, fetched while (on a GPU) the step runs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % c["log_interval"] == 0:
            lossf = loss.item()
            if local_iter_num >= 5:
                mfu = model.estimate_mfu(c["batch_size"], dt)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%")
        iter_num += 1
        local_iter_num += 1
        if iter_num > c["max_iters"]:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
