"""One sublayer's residual connection mirroring jaxgpt/nn/residual.py: where the norm sits
(``norm_placement``) and what the sublayer reads (``parallel_residual``)."""
from __future__ import annotations


def residual(placement: str, x, f, norm, drop, src=None, post=None):
    """x (B, T, d_model) plus sublayer ``f``'s branch, as jaxgpt.nn.residual.residual: 'pre' x + f(norm(x)),
    'post' norm(x + f(x)), 'post_sublayer' x + norm(f(x)), 'sandwich' x + post(f(norm(x)));
    ``src``: what f reads ('pre' only)."""
    if placement not in ("pre", "post", "post_sublayer", "sandwich"):
        raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre', 'post', 'post_sublayer' or 'sandwich'")
    if placement != "pre" and src is not None:
        raise ValueError(f"a parallel residual needs norm_placement='pre', got {placement!r}")
    if placement == "sandwich":
        return x + drop(post(f(norm(x))))
    inp = x if src is None else src
    if placement == "post":
        return norm(x + drop(f(inp)))
    branch = f(norm(inp)) if placement == "pre" else norm(f(inp))
    return x + drop(branch)
