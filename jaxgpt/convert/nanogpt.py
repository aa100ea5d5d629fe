"""nanoGPT checkpoints (``ckpt.pt`` with ``model_args`` and ``model``): the GPT-2 layout with
torch Linear (not Conv1D) weights, an optional ``_orig_mod.`` prefix from torch.compile, and
bias=True/False. nanoGPT uses torch's exact GELU, LayerNorm eps 1e-5 and a tied head."""
from __future__ import annotations

from typing import Any, Mapping

from jaxgpt.config import ModelConfig
from jaxgpt.convert import gpt2
from jaxgpt.convert.common import load_ref

_ARGS = {"n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout"}


def from_nanogpt(checkpoint: str | Mapping[str, Any]) -> tuple[ModelConfig, dict]:
    """A nanoGPT ``ckpt.pt`` (path, read with torch.load, or the loaded dict) -> (config, params)."""
    if isinstance(checkpoint, str):
        import torch

        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=False)
    missing = [k for k in ("model_args", "model") if k not in checkpoint]
    if missing:
        raise ValueError(f"not a nanoGPT checkpoint: missing {missing} (keys: {sorted(checkpoint)})")
    args = checkpoint["model_args"]
    unknown = sorted(set(args) - _ARGS)
    if unknown:
        raise ValueError(f"nanoGPT model_args not supported by jaxgpt: {unknown} (supported: {sorted(_ARGS)})")
    bias = args.get("bias", True)
    config = ModelConfig(
        vocab_size=args["vocab_size"], max_len=args["block_size"], d_model=args["n_embd"], n_layer=args["n_layer"],
        n_head=args["n_head"], pos="learned", norm="layernorm", norm_eps=1e-5, norm_bias=bias, mlp="gelu",
        mlp_bias=bias, qkv_bias=bias, o_bias=bias, tie_embeddings=True, dropout=args.get("dropout", 0.0),
        attn_dropout=None, scale_out_init=True)  # nanoGPT: one dropout for both
    sd = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
    return config, load_ref(config, gpt2.to_ref(sd, config, conv1d=False))
