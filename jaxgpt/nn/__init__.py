"""Flax linen layers: attention (with its KV cache), positions, MLPs, norms, the block and Attention
Residuals; ``kernels`` holds the attention cores behind one dispatch, ``checks`` the jit-safe
(checkify) input checks."""
