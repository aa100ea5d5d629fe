"""torch's own ``nn.Transformer``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``
(seed 004) -> jaxgpt's encoder-decoder (``jaxgpt.models.encdec``) and ``Block``.

Key map (per layer, ``{i}``):
  self_attn.in_proj_{weight,bias} (3d, d)  -> attn.{q,k,v}_proj       split in three along dim 0
  self_attn.out_proj                       -> attn.o_proj
  multihead_attn.*  (decoder)              -> cross_attn.*            (same split)
  linear1 / linear2                        -> mlp.fc_in / mlp.fc_out
  norm1 / norm2 / norm3 .weight            -> attn_norm / mlp_norm (decoder: cross_norm, mlp_norm) .scale
  encoder.norm / decoder.norm              -> encoder.norm / decoder.norm (nn.Transformer always has them)
then the strict generic rule (jaxgpt.convert.rule) checks every key.

``norm_first=True`` is jaxgpt's Pre-LN, ``False`` its Post-LN; ``nn.Transformer`` adds a final
LayerNorm to each stack in both settings (``final_norm=True``). nn.Transformer consumes
embeddings, not ids: the embedding tables and the output Linear live in the model around it and
are named by ``names`` in ``from_torch_transformer``.

Masks mean opposite things: torch's boolean ``key_padding_mask`` / ``attn_mask`` mark positions
*masked out* (True) and float masks are added (-inf = masked); jaxgpt's masks say True =
*attend*. ``attend_mask`` converts one into the other. In eval mode with a key padding mask,
``nn.TransformerEncoder``'s nested-tensor fast path writes zeros (then the final norm) at padded
positions of its output, where jaxgpt computes ordinary vectors; padded positions never reach the
decoder through a ``memory_key_padding_mask``, so logits agree either way.

Config values are read from the live modules (plain attribute access); jaxgpt does not import torch.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import EncDecConfig, ModelConfig
from jaxgpt.convert.rule import state_dict_to_params, to_numpy

_LAYER = {"self_attn.out_proj": "attn.o_proj", "multihead_attn.out_proj": "cross_attn.o_proj",
          "linear1": "mlp.fc_in", "linear2": "mlp.fc_out", "norm1": "attn_norm"}
_NORMS = {False: {"norm2": "mlp_norm"}, True: {"norm2": "cross_norm", "norm3": "mlp_norm"}}
# The model around nn.Transformer: torch_ref key -> the user's key (override with ``names=``).
DEFAULT_NAMES = {"encoder.tok_embed.weight": "src_embed.weight", "decoder.tok_embed.weight": "tgt_embed.weight",
                 "encoder.pos_embed.weight": "src_pos.weight", "decoder.pos_embed.weight": "tgt_pos.weight",
                 "out_proj.weight": "generator.weight", "out_proj.bias": "generator.bias"}


def attend_mask(mask) -> np.ndarray:
    """A torch boolean or additive float mask -> jaxgpt's boolean mask (True = attend), same shape.

    bool: True = masked out, so it is inverted. float: 0 = attend, -inf = masked; any other value
    (a soft bias) has no boolean equivalent and raises ValueError.
    """
    m = to_numpy(mask)
    if m.dtype == bool:
        return ~m
    if m.dtype.kind != "f":
        raise ValueError(f"a torch attention mask is bool or float, got dtype {m.dtype}")
    soft = m[(m != 0) & ~np.isneginf(m)]
    if soft.size:
        raise ValueError(f"float mask value {float(soft.flat[0])} is neither 0 (attend) nor -inf (masked); "
                         "jaxgpt's masks are boolean")
    return m == 0


def _activation(fn) -> str:
    """'relu' or 'gelu' (exact) for F.relu / F.gelu / nn.ReLU() / nn.GELU(); anything else raises."""
    name = getattr(fn, "__name__", None) or type(fn).__name__.lower()
    if name == "gelu" and getattr(fn, "approximate", "none") != "none":
        name = "gelu_tanh"
    if name not in ("relu", "gelu", "gelu_tanh"):
        raise ValueError(f"activation {fn!r} is not supported; use 'relu', 'gelu' or nn.GELU(approximate='tanh')")
    return name


def layer_config(layer, *, vocab_size: int = 1, max_len: int = 256, pos: str = "none") -> ModelConfig:
    """The ModelConfig (one layer) of a live TransformerEncoderLayer / TransformerDecoderLayer."""
    attn = layer.self_attn
    if not getattr(attn, "_qkv_same_embed_dim", True) or attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("only nn.MultiheadAttention with kdim = vdim = embed_dim, add_bias_kv=False and "
                         "add_zero_attn=False is supported")
    act = _activation(layer.activation)
    bias = layer.linear1.bias is not None
    return ModelConfig(
        vocab_size=vocab_size, max_len=max_len, d_model=attn.embed_dim, n_layer=1, n_head=attn.num_heads,
        d_ff=layer.linear1.out_features, pos=pos, norm="layernorm", norm_eps=float(layer.norm1.eps),
        norm_bias=layer.norm1.bias is not None, mlp=act, mlp_bias=bias,
        qkv_bias=attn.in_proj_bias is not None, o_bias=attn.out_proj.bias is not None,
        norm_placement="pre" if layer.norm_first else "post", final_norm=False,
        dropout=float(layer.dropout.p), attn_dropout=float(attn.dropout))


def transformer_config(transformer, *, src_vocab: int, tgt_vocab: int, max_len: int = 256,
                       pos: str = "learned", embed_scale: bool = False, out_bias: bool = True) -> EncDecConfig:
    """EncDecConfig of a live ``nn.Transformer`` plus the embeddings around it (``pos``: 'learned',
    'sinusoidal' or 'none'; ``embed_scale``: token embeddings times sqrt(d_model))."""
    stacks = {}
    for name, vocab in (("encoder", src_vocab), ("decoder", tgt_vocab)):
        stack = getattr(transformer, name)
        cfg = layer_config(stack.layers[0], vocab_size=vocab, max_len=max_len, pos=pos)
        stacks[name] = cfg.replace(n_layer=len(stack.layers), final_norm=stack.norm is not None,
                                   embed_scale=embed_scale)
    return EncDecConfig(stacks["encoder"], stacks["decoder"], out_bias=out_bias)


def _layer_to_ref(sd: Mapping[str, Any], decoder: bool) -> dict[str, np.ndarray]:
    """One layer's keys (no prefix) -> torch_ref Block keys."""
    out = {}
    norms = _NORMS[decoder]
    for key, v in sd.items():
        a = to_numpy(v)
        m = re.fullmatch(r"(self_attn|multihead_attn)\.in_proj_(weight|bias)", key)
        if m:
            attn = "attn" if m.group(1) == "self_attn" else "cross_attn"
            for name, part in zip(("q_proj", "k_proj", "v_proj"), np.split(a, 3, axis=0)):
                out[f"{attn}.{name}.{m.group(2)}"] = np.ascontiguousarray(part)
            continue
        mod, _, leaf = key.rpartition(".")
        mod = _LAYER.get(mod) or norms.get(mod) or mod  # unknown names stay, so the strict rule names them
        if mod.endswith("_norm") and leaf == "weight":
            leaf = "scale"
        out[f"{mod}.{leaf}"] = a
    return out


def _block_template(config: ModelConfig, cross: bool):
    import jax
    import jax.numpy as jnp

    from jaxgpt.nn.block import Block

    def init():
        x = jnp.zeros((1, 1, config.d_model), jnp.float32)
        return Block(config, causal=cross, cross=cross).init(jax.random.PRNGKey(0), x, x if cross else None)

    return jax.eval_shape(init)["params"]


def encoder_layer_params(state_dict: Mapping[str, Any], config: ModelConfig) -> dict:
    """A TransformerEncoderLayer's state dict -> params of ``Block(config, causal=False)``."""
    return state_dict_to_params(_layer_to_ref(state_dict, decoder=False), _block_template(config, cross=False))


def decoder_layer_params(state_dict: Mapping[str, Any], config: ModelConfig) -> dict:
    """A TransformerDecoderLayer's state dict -> params of ``Block(config, causal=True, cross=True)``."""
    return state_dict_to_params(_layer_to_ref(state_dict, decoder=True), _block_template(config, cross=True))


def from_torch_transformer(state_dict: Mapping[str, Any], config: EncDecConfig, *, prefix: str = "transformer.",
                           names: Mapping[str, str] | None = None) -> dict:
    """The state dict of a model holding an ``nn.Transformer`` under ``prefix`` -> EncoderDecoder params.

    ``names`` maps torch_ref keys of the parts outside nn.Transformer (token/position embeddings,
    output Linear) to the model's own keys; DEFAULT_NAMES fits ``src_embed``, ``tgt_embed``,
    ``src_pos``, ``tgt_pos`` and ``generator``. Strict: every unused or missing key is named.
    """
    from jaxgpt.models import abstract_params, stacked_paths

    theirs = {v: k for k, v in {**DEFAULT_NAMES, **(names or {})}.items()}
    ref: dict[str, np.ndarray] = {}
    layers: dict[tuple[str, int], dict] = {}
    for key, v in state_dict.items():
        if key in theirs:
            ref[theirs[key]] = to_numpy(v)
            continue
        m = re.fullmatch(re.escape(prefix) + r"(encoder|decoder)\.layers\.(\d+)\.(.+)", key)
        if m:
            layers.setdefault((m.group(1), int(m.group(2))), {})[m.group(3)] = v
        else:  # encoder.norm.weight -> encoder.norm.scale; anything else is reported by the rule
            key = key.removeprefix(prefix)
            ref[re.sub(r"^((?:en|de)coder\.norm)\.weight$", r"\1.scale", key)] = to_numpy(v)
    for (stack, i), sd in layers.items():
        for k, a in _layer_to_ref(sd, decoder=stack == "decoder").items():
            ref[f"{stack}.layers.{i}.{k}"] = a
    return state_dict_to_params(ref, abstract_params(config), stacked=stacked_paths(config))
