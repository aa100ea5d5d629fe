"""Train a jaxgpt preset as a Flax NNX module: nnx.Optimizer + nnx.jit, on a text file, characters as tokens.

    python examples/nnx_train.py                       # ../shared/data/tinyshakespeare.txt beside the repo
    python examples/nnx_train.py --text my.txt --steps 200

The optimizer is jaxgpt's (make_optimizer: AdamW, warmup + cosine, clipping, the weight-decay mask) and
the loss is fit's (jaxgpt.nnx.loss): the update jaxgpt.train's step makes on the same batch.
"""
import argparse
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

import jaxgpt.nnx as jnnx
from jaxgpt.config import TrainConfig
from jaxgpt.data import CharTokenizer, get_batch, load_text
from jaxgpt.inference.generate import generate
from jaxgpt.train import make_optimizer

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--text", default=str(DEFAULT_TEXT), help="a UTF-8 text file (default: %(default)s)")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

text = load_text(args.text)
tok = CharTokenizer.from_text(text)
data = tok.encode(text)  # (N,) int32
tc = TrainConfig(steps=args.steps, lr=3e-3, warmup_steps=5, decay="linear", batch_size=16, seq_len=64)
config, model = jnnx.from_preset("gpt2-shakespeare-char", vocab_size=tok.vocab_size, n_layer=2, d_model=128,
                                 n_head=4, dropout=0.0, seed=tc.seed)
optimizer = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(jnnx.loss)(model, batch, True)  # mean next-token cross entropy
    optimizer.update(model, grads)  # updates model's Params in place
    return loss


for step in range(tc.steps):
    x, y = get_batch(data, tc.batch_size, tc.seq_len, tc.seed, step)  # (B, T) each, a function of (seed, step)
    loss = train_step(model, optimizer, {"x": x, "y": y})
    if step % 10 == 0 or step == tc.steps - 1:
        print(f"step {step:3d}  loss {float(loss):.3f}")

print("logits", model(jnp.asarray(x[:1])).shape)  # the module's own call: (1, T) ids -> (1, T, vocab)
prompt = jnp.asarray(tok.encode("ROMEO:"))[None]  # generate takes the linen params dict
print(tok.decode(generate(config, jnnx.to_params(model), prompt, 40)[0].tolist()))
