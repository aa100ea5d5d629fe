"""One sublayer's residual connection mirroring jaxgpt/nn/residual.py: where the norm sits
(``norm_placement``) and what the sublayer reads (``parallel_residual``)."""
from __future__ import annotations


def residual(placement: str, x, f, norm, drop, src=None):
    """x (B, T, d_model) plus sublayer ``f``'s branch, as jaxgpt.nn.residual.residual: 'pre' x + f(norm(x)),
    'post' norm(x + f(x)), 'post_sublayer' x + norm(f(x)); ``src``: what f reads ('pre' only)."""
    if placement not in ("pre", "post", "post_sublayer"):
        raise ValueError(f"unknown norm_placement {placement!r}; expected 'pre', 'post' or 'post_sublayer'")
    if placement != "pre" and src is not None:
        raise ValueError(f"a parallel residual needs norm_placement='pre', got {placement!r}")
    inp = x if src is None else src
    if placement == "post":
        return norm(x + drop(f(inp)))
    branch = f(norm(inp)) if placement == "pre" else norm(f(inp))
    return x + drop(branch)
