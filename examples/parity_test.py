"""A parity test with jaxgpt's public API only (needs torch: pip install 'jaxgpt[testing]'): a GQA + RoPE
attention and a pre-norm decoder block (RMSNorm, SwiGLU) against their torch twins in torch_ref, forward and
every gradient at 1e-5, each also against the twin in float64 (jaxgpt.testing.check_module).

    python examples/parity_test.py   # prints the worst error per check; exit status 1 if one fails
    pytest examples/parity_test.py   # the same checks as pytest tests
"""
import sys

import numpy as np
import torch

from jaxgpt.config import ModelConfig
from jaxgpt.nn.attention import Attention
from jaxgpt.nn.block import Block
from jaxgpt.testing import Comparison, check_module, listening
from torch_ref.nn.attention import Attention as TorchAttention
from torch_ref.nn.block import Block as TorchBlock

TOL = 1e-5  # float32, max abs; gradients per parameter / max(1, max |g|). jit=True: compile once, not op by op
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 7, 32)).astype(np.float32)  # (B, T, d_model)
pad = np.ones((2, 1, 1, 7), bool)  # (B, 1, 1, T) key mask, True = attend
pad[1, ..., 5:] = False  # the second row is two tokens shorter


def test_gqa_rope_attention():
    kw = dict(d_model=32, n_head=4, n_kv_head=2, rope=True)  # 4 query heads share 2 key/value heads
    check_module("GQA + RoPE attention", Attention(**kw), TorchAttention(**kw), [x], tol=TOL, jit=True,
                 jax_kwargs=dict(mask=pad, is_causal=True), select=lambda out: out[0],  # (y, cache, weights)
                 torch_kwargs=dict(mask=torch.from_numpy(pad), is_causal=True))


def test_decoder_block():
    cfg = ModelConfig(d_model=32, n_head=4, n_kv_head=2, pos="rope", norm="rmsnorm", mlp="swiglu")
    check_module("decoder block", Block(cfg), TorchBlock(cfg), [x], tol=TOL, jit=True, select=lambda out: out[0],
                 jax_kwargs=dict(mask=pad), torch_kwargs=dict(mask=torch.from_numpy(pad)))


def main() -> int:
    failed = 0
    for name, test in [(n, f) for n, f in globals().items() if n.startswith("test_")]:
        worst = {}  # component -> worst error: every comparison reaches the listeners

        def keep(e, worst=worst):
            if isinstance(e, Comparison):
                worst[e.component] = max(e.err, worst.get(e.component, 0.0))
        try:
            with listening(keep):
                test()
        except AssertionError as e:
            failed += 1
            print(f"FAIL  {name}: {e}")
            continue
        print(f"ok    {name}\n" + "\n".join(f"        {k:<45} {v:.2e}" for k, v in worst.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
