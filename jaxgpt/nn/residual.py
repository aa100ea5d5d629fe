"""One sublayer's residual connection: where its norm sits (``ModelConfig.norm_placement``) and what it
reads (``ModelConfig.parallel_residual``). No framework code: ``f``, ``norm`` and ``drop`` are the caller's
modules (torch_ref/nn/residual.py is its twin)."""
from __future__ import annotations


def residual(placement: str, x, f, norm, drop, src=None, post=None):
    """x (B, T, d_model) plus sublayer ``f``'s branch; ``drop`` is the residual-branch dropout.

    'pre': x + f(norm(x)); 'post': norm(x + f(x)); 'post_sublayer': x + norm(f(x)) (OLMo 2);
    'sandwich': x + post(f(norm(x))) (Gemma 2). ``src``: what f reads instead of x (a parallel
    residual's MLP reads the layer's input, 'pre' only).
    """
    h = x if src is None else src
    if placement == "pre":
        return x + drop(f(norm(h)))
    if src is not None:
        raise ValueError(f"a parallel residual needs norm_placement='pre', got {placement!r}")
    if placement == "sandwich":
        return x + drop(post(f(norm(x))))
    if placement == "post_sublayer":
        return x + drop(norm(f(x)))
    if placement == "post":
        return norm(x + drop(f(x)))
    raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre', 'post', 'post_sublayer' or 'sandwich'")
