"""The torch side of ``jaxgpt parity``: for each checkpoint format, the checkpoint's own torch model
next to its jaxgpt conversion, a forward pass that records every layer's output, and the way back
from torch gradients to a jaxgpt params tree.

Reference models (see jaxgpt.tools.parity for the reasoning): an HF directory runs its transformers class;
a nanoGPT ``ckpt.pt`` runs transformers' GPT2LMHeadModel (nanoGPT's architecture); a torch_ref ``.pt``
runs torch_ref, imported here lazily, for that input only. Nothing in this module imports torch,
transformers or torch_ref at import time.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

def _nanogpt_as_gpt2(obj: dict):
    """A nanoGPT checkpoint dict -> transformers GPT2LMHeadModel holding its weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    a = obj["model_args"]
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=a["vocab_size"], n_positions=a["block_size"], n_embd=a["n_embd"],
                                    n_layer=a["n_layer"], n_head=a["n_head"], activation_function="gelu",
                                    layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None))
    sd = {k.removeprefix("_orig_mod."): v for k, v in obj["model"].items() if not k.endswith(".attn.bias")}
    # nanoGPT's Linear stores (out, in); HF's Conv1D (in, out)
    sd = {k: v.t() if v.dim() == 2 and ".h." in k else v for k, v in sd.items()}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(sd[name] if name in sd else torch.zeros_like(p))  # bias=False: zero biases
    return hf.eval()


def _through_from_hf(model, tensors: dict[str, np.ndarray]) -> dict:
    """The params tree of ``tensors`` (keyed like ``model.named_parameters()``: gradients, stepped
    weights) through the public ``from_hf``: swapped into the model for the call, then restored."""
    import torch

    from jaxgpt.convert import from_hf

    saved = {}
    try:
        for k, p in model.named_parameters():
            saved[k] = p.data
            p.data = torch.from_numpy(np.ascontiguousarray(tensors[k]))
        return from_hf(model)[1]
    finally:
        named = dict(model.named_parameters())
        for k, data in saved.items():
            named[k].data = data


def load_sides(source: str | Path, dtype: str = "float32") -> dict:
    """Both sides of ``source``: {'config', 'params', 'torch' (module), 'kind' ('hf' | 'nanogpt' |
    'torch_ref'), 'tokenizer' (HF only, or None), 'grads_to_jax' (torch named grads -> params tree)}."""
    import torch

    from jaxgpt.convert.files import detect_format

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    fmt = detect_format(source)
    if fmt == "hf":
        import transformers

        from jaxgpt.convert.hf import load_hf
        from jaxgpt.data.hf_tokenizer import HFTokenizer

        config, params = load_hf(source)
        arch = transformers.AutoConfig.from_pretrained(source, local_files_only=True).architectures[0]
        model = getattr(transformers, arch).from_pretrained(source, local_files_only=True,
                                                            attn_implementation="eager").eval()
        tok = HFTokenizer.from_dir(source) if (Path(source) / "tokenizer.json").is_file() else None
        grads = lambda g: _through_from_hf(model, g)
        side = {"kind": "hf", "tokenizer": tok}
    elif fmt == "torch":
        obj = torch.load(source, map_location="cpu", weights_only=False)
        if isinstance(obj, dict) and "model_args" in obj:
            from jaxgpt.convert.nanogpt import from_nanogpt

            config, params = from_nanogpt(obj)
            model = _nanogpt_as_gpt2(obj)
            own = {k.removeprefix("_orig_mod.") for k in obj["model"]}
            t2n = lambda k, v: v.T if v.ndim == 2 and ".h." in k else v
            grads = lambda g: from_nanogpt({"model_args": obj["model_args"],
                                            "model": {k: t2n(k, v) for k, v in g.items() if k in own}})[1]
            side = {"kind": "nanogpt", "tokenizer": None}
        else:
            import torch_ref  # the torch implementation of torch_ref files (see the module docstring)

            from jaxgpt.convert.files import load_weights
            from jaxgpt.convert.rule import state_dict_to_params
            from jaxgpt.models import abstract_params, stacked_paths

            config, params, _ = load_weights(source, "torch")
            model = torch_ref.build(config)
            model.load_state_dict(obj["state_dict"], strict=True)
            model.eval()
            template, stacked = abstract_params(config), stacked_paths(config)
            grads = lambda g: state_dict_to_params(g, template, stacked=stacked)
            side = {"kind": "torch_ref", "tokenizer": None}
    else:
        raise ValueError(f"{source}: jaxgpt parity compares a torch checkpoint (HF directory, nanoGPT ckpt.pt or "
                         f"torch_ref .pt) with its conversion; got a {fmt!r} file")
    from jaxgpt.config import EncDecConfig

    if isinstance(config, EncDecConfig):
        raise ValueError(f"{source}: parity for encoder-decoder files is not supported (parity_tests/test_encdec.py "
                         "covers them against torch_ref)")
    return {"config": config, "params": params, "torch": model.to(tdtype), "grads_to_jax": grads, **side}


def _layers_module(model, n_layer: int):
    """The torch ModuleList of the transformer layers (HF h / layers / encoder.layer, torch_ref layers)."""
    import torch

    for _, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n_layer:
            return m
    return None


def torch_forward(side, inputs, grad: bool = False):
    """(logits tensor, [per-layer outputs (B, T, d)]) from the torch model; hooks record each layer's output."""
    import torch

    model, config = side["torch"], side["config"]
    n = config.encoder.n_layer if hasattr(config, "encoder") else config.n_layer
    layers, hidden, hooks = _layers_module(model, n), [], []
    if layers is not None:
        for layer in layers:
            hooks.append(layer.register_forward_hook(
                lambda m, a, out: hidden.append((out[0] if isinstance(out, tuple) else out).detach().float().numpy())))
    ids = torch.from_numpy(inputs["ids"]).long()
    try:
        with torch.set_grad_enabled(grad):
            if "mask" in inputs:
                mask = torch.from_numpy(inputs["mask"])
                out = model(ids, attention_mask=mask.long()) if side["kind"] == "hf" else model(ids, mask)
            else:
                out = model(ids)
            logits = getattr(out, "logits", None)
            logits = (out.last_hidden_state if logits is None and hasattr(out, "last_hidden_state")
                      else logits if logits is not None else out)
    finally:
        for h in hooks:
            h.remove()
    return logits, hidden
