"""Your own jit + optax training loop over jaxgpt's public pieces: a character model on a text file.

    python examples/own_loop.py [--text ../shared/data/tinyshakespeare.txt] [--steps 200]
"""
import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import jaxgpt
from jaxgpt.data import CharTokenizer, get_batch, split_train_val
from jaxgpt.inference.generate import generate
from jaxgpt.models import build, init_params
from jaxgpt.train import cross_entropy
from jaxgpt.train.optim import DECAY_MASKS

p = argparse.ArgumentParser()
p.add_argument("--text", default=Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt")
p.add_argument("--steps", type=int, default=200)
args = p.parse_args()
jaxgpt.use_host_devices()  # optional, before JAX starts: one CPU device per core (used by mesh='auto' training)

text = Path(args.text).read_text()
tok = CharTokenizer.from_text(text)
train, val = split_train_val(tok.encode(text))
config = jaxgpt.get_preset("gpt2-shakespeare-char").replace(
    vocab_size=tok.vocab_size, n_layer=2, n_head=4, d_model=64, max_len=64, dropout=0.0)
model, params = build(config), init_params(config, jax.random.PRNGKey(0))
# AdamW decaying only the Linear kernels and embeddings (nanoGPT's and HF Trainer's choice)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, args.steps), weight_decay=0.1,
    mask=DECAY_MASKS["matrices"](params)))
opt_state = tx.init(params)


def loss_fn(params, x, y):
    total, count, _ = cross_entropy(model.apply({"params": params}, x), y)  # logits (B, T, V)
    return total / count


eval_loss = jax.jit(loss_fn)


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


for step in range(args.steps):
    x, y = get_batch(train, 16, 64, seed=0, step=step)  # (B, T) windows, a pure function of (seed, step)
    params, opt_state, loss = train_step(params, opt_state, x, y)
    if step % 50 == 0 or step == args.steps - 1:
        vx, vy = get_batch(val, 16, 64, seed=1, step=0)
        print(f"step {step:4d}  train {float(loss):.3f}  val {float(eval_loss(params, vx, vy)):.3f}")
prompt = jnp.asarray(tok.encode("ROMEO:"))[None]  # (1, T0)
print(tok.decode(generate(config, params, prompt, 40, temperature=0.8, rng=jax.random.PRNGKey(1))[0]))
