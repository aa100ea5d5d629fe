"""A Hugging Face directory in, fine-tuned on a text file, a Hugging Face directory out: weights,
tokenizer, chat template, special ids and generation config, all readable by transformers.

    python examples/hf_finetune.py HF_DIR OUT_DIR --text FILE [--steps 100]
"""
import argparse

import jax
import numpy as np
import optax

from jaxgpt import build
from jaxgpt.convert import load_hf, save_hf
from jaxgpt.data import get_batch, split_train_val
from jaxgpt.data.hf_tokenizer import HFTokenizer
from jaxgpt.train import cross_entropy
from jaxgpt.train.optim import DECAY_MASKS

p = argparse.ArgumentParser()
p.add_argument("hf_dir")
p.add_argument("out_dir")
p.add_argument("--text", required=True)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--seq-len", type=int, default=64)
args = p.parse_args()

config, params, extras = load_hf(args.hf_dir, with_extras=True)  # extras["tokenizer"]: what the export needs
tok = HFTokenizer.from_dir(args.hf_dir)
train, val = split_train_val(np.asarray(tok.encode(open(args.text).read()), np.int32))
model, seq_len = build(config), min(args.seq_len, config.max_len)
# fine-tuning as HF Trainer does it: warmup, then cosine; norms and biases are not decayed
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(1, args.steps // 20), args.steps), weight_decay=0.1,
    mask=DECAY_MASKS["matrices"](params)))
opt_state = tx.init(params)


def loss_fn(params, x, y):
    total, count, _ = cross_entropy(model.apply({"params": params}, x), y)  # logits (B, T, V)
    return total / count


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


eval_loss = jax.jit(loss_fn)
for step in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state, *get_batch(train, 8, seq_len, seed=0, step=step))
    if step % 25 == 0 or step == args.steps - 1:
        val_loss = eval_loss(params, *get_batch(val, 8, seq_len, seed=1, step=0))
        print(f"step {step:4d}  train {float(loss):.3f}  val {float(val_loss):.3f}")
save_hf(args.out_dir, config, params, tokenizer=extras["tokenizer"])
print(f"wrote {args.out_dir}: load it with transformers' from_pretrained, or jaxgpt.convert.load_hf")
