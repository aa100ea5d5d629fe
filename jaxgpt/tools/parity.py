"""``jaxgpt parity``: run a torch checkpoint and its jaxgpt twin on the same inputs and report where
they disagree: per-layer hidden states (naming the first layer above tolerance), logits (max abs,
KL divergence, top-1 agreement), optionally every parameter's loss gradient and one AdamW step,
and greedy generation with and without the KV cache against torch's own generate.

Which torch model is the reference (decision): the checkpoint's *own* implementation wherever one
exists outside jaxgpt's converters:
- a Hugging Face directory: its transformers class (``from_pretrained``, eager attention);
- a nanoGPT ``ckpt.pt``: transformers' GPT2LMHeadModel, which is nanoGPT's architecture (exact
  GELU, LayerNorm eps 1e-5, tied head; ``bias=False`` as zero biases); the Linear -> Conv1D
  transposes are done here, in torch, not by jaxgpt's converter;
- a torch_ref ``.pt`` (written by ``jaxgpt convert``): torch_ref, the only torch implementation of
  those models. This is the one place jaxgpt imports torch_ref, lazily, for that input only.
jaxgpt.tools.parity_sides builds those models and imports torch, transformers and torch_ref inside
functions only: ``import jaxgpt`` (and ``import jaxgpt.tools.parity``) stays torch-free.

Numerics: float32 runs with ``jax_default_matmul_precision='highest'`` and TF32 off in torch,
torch seeded with ``seed`` (``reference_numerics``: for the duration of ``run`` only; JAX's and
torch's global settings and torch's CPU random state are as before afterwards, also after an
error). Errors are judged as max |jax - torch| / max(1, max |torch|) (unit-scale tensors are
judged by their plain max abs error; large ones relative to their scale) against ``tol`` (1e-5
in float32, 5e-2 in bfloat16, where generation is reported but not judged).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.tools.parity_sides import load_sides, torch_forward

DEFAULT_TOL = {"float32": 1e-5, "bfloat16": 5e-2}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


# --- running ------------------------------------------------------------------------------------

def make_inputs(config, tokenizer=None, prompt: str | None = None, batch: int = 2, seq_len: int = 16,
                seed: int = 0) -> dict:
    """ids (B, T) and, for BERT, a padded batch: mask (B, T) with rows of decreasing length."""
    from jaxgpt.config import BertConfig

    bert = isinstance(config, BertConfig)
    enc = config.encoder if bert else config
    rng = np.random.default_rng(seed)
    if prompt is not None:
        if tokenizer is None:
            raise ValueError("--prompt needs a tokenizer.json (HF directories); other sources use random ids")
        row = tokenizer.encode(prompt)
        if not 0 < len(row) <= enc.max_len:
            raise ValueError(f"--prompt encodes to {len(row)} tokens; it must be 1..max_len={enc.max_len}")
        ids = row[None].astype(np.int32)
        if bert:  # the prompt and its first half, padded: the padded batch BERT is tested on
            ids = np.stack([row, np.where(np.arange(len(row)) < max(1, len(row) // 2), row, tokenizer.pad_id or 0)])
    else:
        t = min(seq_len, enc.max_len)
        ids = rng.integers(0, enc.token_vocab, (batch if not bert else max(batch, 2), t)).astype(np.int32)
    inputs = {"ids": ids.astype(np.int32)}
    if bert:
        b, t = ids.shape
        lengths = [t] + [max(1, t - (i * t) // b) if prompt is None else max(1, t // 2) for i in range(1, b)]
        inputs["mask"] = np.arange(t)[None] < np.asarray(lengths)[:, None]
    return inputs


def _jax_forward(config, params, inputs):
    """(logits, hidden (L, B, T, d) or None) from the jaxgpt model, per-layer outputs via capture_intermediates."""
    import jax

    from jaxgpt.config import BertConfig
    from jaxgpt.models import build

    model = build(config)
    args = (inputs["ids"], inputs["mask"]) if isinstance(config, BertConfig) else (inputs["ids"],)
    kw = {"return_hidden": True} if isinstance(config, BertConfig) and "classifier" not in params else {}
    # a bare BertModel (no classifier) gives hidden states only

    @jax.jit
    def forward(p, *a):
        return model.apply({"params": p}, *a, **kw, mutable=["intermediates"],
                           capture_intermediates=lambda m, name: m.name == "layers" and name == "__call__")

    out, st = forward(params, *args)
    layers = st.get("intermediates", {}).get("layers", {}).get("__call__")
    hidden = np.asarray(layers[0][0], np.float32) if layers else None  # scanned Blocks: (L, B, T, d)
    return np.asarray(out, np.float32), hidden


def _loss(logits, ids, xp):
    """Mean next-token cross entropy (decoders, logits (B, T, V)) or class cross entropy with labels
    arange(B) % n_classes (classifiers, logits (B, C)); ``xp``: jax.numpy or torch."""
    if logits.ndim == 3:
        lg, y = logits[:, :-1], ids[:, 1:]
    else:
        lg, y = logits, (xp.arange(logits.shape[0]) % logits.shape[-1])
    if xp.__name__ == "torch":
        return xp.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1).long())
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(lg.reshape(-1, lg.shape[-1]).astype("float32"),
                                                           y.reshape(-1)).mean()


def _err(a, ref) -> dict:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if a.shape != ref.shape:
        raise ValueError(f"shape mismatch: jaxgpt {a.shape} vs torch {ref.shape}")
    d = np.abs(a - ref)
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    return {"max_abs": float(d.max()) if d.size else 0.0, "mean_abs": float(d.mean()) if d.size else 0.0,
            "scaled": float(d.max()) / scale if d.size else 0.0}


def _logit_stats(a, ref) -> dict:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    from scipy.special import log_softmax

    lp, lq = log_softmax(ref, axis=-1), log_softmax(a, axis=-1)  # float64: the KL is not rounding noise
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    return {**_err(a, ref), "kl": kl, "top1": float((a.argmax(-1) == ref.argmax(-1)).mean())}


# torch >= 2.9: the fp32_precision flags are the state; the legacy allow_tf32 flags are views of
# them that raise once both APIs have been used, so only these are read, set and put back.
_TORCH_FP32 = (("cuda.matmul", "fp32_precision"), ("cudnn.conv", "fp32_precision"), ("cudnn.rnn", "fp32_precision"))
_TORCH_LEGACY = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))


def _torch_flags(torch) -> list[tuple[object, str]]:
    """(object, attribute) of torch's TF32 switches, in the API this torch has."""
    new = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    out = []
    for path, attr in _TORCH_FP32 if new else _TORCH_LEGACY:
        obj = torch.backends
        for part in path.split("."):
            obj = getattr(obj, part)
        out.append((obj, attr))
    return out


@contextlib.contextmanager
def reference_numerics(seed: int = 0):
    """For the duration of the block: JAX float32 matmuls at 'highest' precision, TF32 off in
    torch, torch's CPU generator seeded with ``seed``. On exit (errors included) everything is as
    it was: JAX's precision is a scoped setting, torch's flags are restored, its RNG forked."""
    import jax
    import torch

    flags = _torch_flags(torch)
    saved = [getattr(obj, attr) for obj, attr in flags]
    off = "ieee" if flags[0][1] == "fp32_precision" else False
    with jax.default_matmul_precision("highest"), torch.random.fork_rng(devices=[]):
        try:
            for obj, attr in flags:
                setattr(obj, attr, off)
            torch.manual_seed(seed)
            yield
        finally:
            for (obj, attr), value in zip(flags, saved):
                setattr(obj, attr, value)


def run(source: str | Path, *, prompt: str | None = None, batch: int = 2, seq_len: int = 16, seed: int = 0,
        dtype: str = "float32", tol: float | None = None, grads: bool = False, generate: int = 8) -> dict:
    """The parity report of ``source`` (see the module docstring) as a JSON-able dict; ``report['ok']``."""
    if dtype not in DEFAULT_TOL:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DEFAULT_TOL)}")
    if generate < 0:
        raise ValueError(f"--generate must be >= 0 new tokens, got {generate}")
    for name, value in (("--batch-size", batch), ("--seq-len", seq_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    tol = DEFAULT_TOL[dtype] if tol is None else float(tol)
    with reference_numerics(seed):
        return _run(source, prompt, batch, seq_len, seed, dtype, tol, grads, generate)


def _run(source, prompt, batch, seq_len, seed, dtype, tol, grads, generate) -> dict:
    import jax

    side = load_sides(source, dtype)
    config, params = side["config"], side["params"]
    if dtype != "float32":
        params = jax.tree.map(lambda a: np.asarray(a).astype(jax.numpy.bfloat16), params)
    inputs = make_inputs(config, side["tokenizer"], prompt, batch, seq_len, seed)
    report: dict[str, Any] = {"source": str(source), "kind": side["kind"], "model": type(config).__name__,
                              "dtype": dtype, "tol": tol, "input_shape": list(inputs["ids"].shape)}

    logits, hidden = _jax_forward(config, params, inputs)
    t_logits, t_hidden = torch_forward(side, inputs)
    layers = []
    if hidden is not None and len(t_hidden) == len(hidden):
        for i, (h, th) in enumerate(zip(hidden, t_hidden)):
            layers.append({"layer": i, **_err(h, th)})
            layers[-1]["ok"] = layers[-1]["scaled"] <= tol
    report["layers"] = layers
    report["first_bad_layer"] = next((r["layer"] for r in layers if not r["ok"]), None)
    report["logits"] = {**_logit_stats(logits, t_logits.detach().float().numpy())}
    report["logits"]["ok"] = report["logits"]["scaled"] <= tol
    if grads:
        report["grads"], report["adamw"] = _grads_and_adamw(side, params, inputs, tol)
    if generate and not hasattr(config, "encoder"):
        report["generate"] = _generation(side, params, inputs["ids"][:1], generate, judged=dtype == "float32")
    checks = [*layers, report["logits"], report.get("grads", {}), report.get("adamw", {}), report.get("generate", {})]
    report["ok"] = all(c.get("ok", True) for c in checks)
    return report


def _grads_and_adamw(side, params, inputs, tol):
    """Loss gradients for every parameter, then one AdamW step on each side from the *torch*
    gradients (so the step compares optax with torch.optim.AdamW, not the gradients again)."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    from jaxgpt.config import BertConfig, TrainConfig
    from jaxgpt.models import build
    from jaxgpt.train.optim import make_optimizer

    config, model = side["config"], side["torch"]
    args = (inputs["ids"], inputs["mask"]) if isinstance(config, BertConfig) else (inputs["ids"],)
    loss = lambda p, *a: _loss(build(config).apply({"params": p}, *a), a[0], jnp)
    g = jax.jit(jax.grad(loss))(params, *args)  # compiled: the eager backward through the scan is far slower
    model.zero_grad()
    logits, _ = torch_forward(side, inputs, grad=True)
    _loss(logits, torch.from_numpy(inputs["ids"]), torch).backward()
    named = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).float().numpy()
             for k, p in model.named_parameters()}
    tg = side["grads_to_jax"](named)
    pairs = jax.tree.map(lambda a, b: (a, b), g, tg)  # same structure, or jax names the difference
    per = {"/".join(str(k.key) for k in path): _err(*ab) for path, ab in
           jax.tree_util.tree_flatten_with_path(pairs, is_leaf=lambda x: isinstance(x, tuple))[0]}
    worst = max(per, key=lambda k: per[k]["scaled"])
    bad = sorted(k for k, v in per.items() if v["scaled"] > tol)
    grads = {"params": per, "worst": worst, "scaled": per[worst]["scaled"], "max_abs": per[worst]["max_abs"],
             "over_tol": bad, "ok": not bad, "notes": _padding_notes(side, named, g, tg)}

    tc = TrainConfig(lr=ADAMW["lr"], beta1=ADAMW["betas"][0], beta2=ADAMW["betas"][1], eps=ADAMW["eps"],
                     weight_decay=ADAMW["weight_decay"], schedule="constant", grad_clip=None, warmup_steps=0)
    opt = make_optimizer(tc)
    tg = jax.tree.map(lambda a, p: jnp.asarray(a, p.dtype), tg, params)
    new = jax.jit(lambda p, gr: optax.apply_updates(p, opt.update(gr, opt.init(p), p)[0]))(params, tg)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    stepped = side["grads_to_jax"]({k: p.detach().float().numpy() for k, p in model.named_parameters()})
    with torch.no_grad():  # the torch model goes back to the checkpoint's weights for what follows
        for k, p in model.named_parameters():
            p.copy_(before[k])
    model.zero_grad(set_to_none=True)
    errs = jax.tree_util.tree_leaves(jax.tree.map(lambda a, b: _err(a, b), new, stepped),
                                     is_leaf=lambda x: isinstance(x, dict) and "max_abs" in x)
    adamw = {"hyper": {**ADAMW, "betas": list(ADAMW["betas"])}, "max_abs": max(e["max_abs"] for e in errs),
             "scaled": max(e["scaled"] for e in errs)}
    adamw["ok"] = adamw["scaled"] <= tol
    return grads, adamw


def _padding_notes(side, named, g, tg) -> list[str]:
    """torch's nn.Embedding(padding_idx=i) never gives row i a gradient; jaxgpt's token embedding does
    too when its config has ``pad_token_id=i`` (the HF importers set it), other tables do not. Say so
    for any other, with the error of the rest of that table (the row is located through the converter)."""
    import jax
    import torch

    config = side["config"]
    frozen = getattr(getattr(config, "encoder", config), "pad_token_id", None)
    notes = []
    for name, mod in side["torch"].named_modules():
        if not (isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None):
            continue
        marker = {k: np.zeros_like(v) for k, v in named.items()}
        marker[f"{name}.weight"][mod.padding_idx] = 1.0
        where = side["grads_to_jax"](marker)
        for (path, m), a, b in zip(jax.tree_util.tree_leaves_with_path(where), jax.tree_util.tree_leaves(g),
                                   jax.tree_util.tree_leaves(tg)):
            rows = np.asarray(m).reshape(np.shape(m)[0], -1).any(-1) if np.ndim(m) else None
            where_jax = "/".join(str(k.key) for k in path)
            if rows is None or not rows.any() or (where_jax == "tok_embed/embedding" and mod.padding_idx == frozen):
                continue  # not this table, or jaxgpt's token embedding freezes the same row
            rest = _err(np.asarray(a)[~rows], np.asarray(b)[~rows])["scaled"]
            notes.append(f"torch's {name} has padding_idx={mod.padding_idx}: torch never updates that row, jaxgpt "
                         f"does; {where_jax} without it: error {rest:.2e}")
    return notes


def _generation(side, params, prompt, n: int, judged: bool) -> dict:
    """Greedy tokens: jaxgpt with and without the KV cache vs torch's generate (HF generate /
    torch_ref.generate), all on one prompt row; EOS does not stop either side."""
    import torch

    from jaxgpt.inference.generate import generate

    config, model = side["config"], side["torch"]
    n = min(n, config.max_len - prompt.shape[1])
    if n < 1:
        return {"skipped": f"prompt fills max_len={config.max_len}"}
    ours = {}
    for c in (True, False):
        try:
            ours[c] = np.asarray(generate(config, params, prompt, n, use_cache=c))[0, prompt.shape[1]:].tolist()
        except Exception as e:  # noqa: BLE001 - reported as this path's result (e.g. a dtype the cached path rejects)
            ours[c] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    ids = torch.from_numpy(prompt).long()
    with torch.no_grad():
        if side["kind"] == "torch_ref":
            from torch_ref.generate import generate as torch_generate

            theirs = torch_generate(model, ids, n)[0, prompt.shape[1]:].tolist()
        else:
            model.generation_config.eos_token_id = None  # fixed length on both sides
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            theirs = out[0, prompt.shape[1]:].tolist()
    first = {c: 0 if isinstance(ours[c], str) else next((i for i, (a, b) in enumerate(zip(ours[c], theirs)) if a != b),
                                                         None) for c in ours}
    res = {"new_tokens": n, "torch": theirs, "cached": ours[True], "uncached": ours[False],
           "first_mismatch_cached": first[True], "first_mismatch_uncached": first[False], "judged": judged}
    res["ok"] = (not judged) or (first[True] is None and first[False] is None)
    return res


# --- output -------------------------------------------------------------------------------------

def format_table(report: dict) -> str:
    """The report as a fixed-width table (what ``jaxgpt parity`` prints)."""
    tol = report["tol"]
    rows = [f"{report['source']} ({report['kind']}, {report['model']}, {report['dtype']}, input "
            f"{'x'.join(map(str, report['input_shape']))}); error = max|jax-torch| / max(1, max|torch|), "
            f"tol {tol:.0e}", f"{'check':<36}{'max abs':>11}{'mean abs':>11}{'error':>11}  result"]
    mark = lambda ok: "ok" if ok else "FAIL"
    for r in report["layers"]:
        rows.append(f"{'layer ' + str(r['layer']):<36}{r['max_abs']:>11.2e}{r['mean_abs']:>11.2e}"
                    f"{r['scaled']:>11.2e}  {mark(r['ok'])}")
    lg = report["logits"]
    rows.append(f"{'logits':<36}{lg['max_abs']:>11.2e}{lg['mean_abs']:>11.2e}{lg['scaled']:>11.2e}  {mark(lg['ok'])}"
                f"  (KL {lg['kl']:.2e}, top-1 agreement {lg['top1']:.1%})")
    if "grads" in report:
        g, a = report["grads"], report["adamw"]
        rows.append(f"{'grads (worst: ' + g['worst'] + ')':<36}{g['max_abs']:>11.2e}{'':>11}{g['scaled']:>11.2e}  "
                    f"{mark(g['ok'])}  ({len(g['params'])} parameters, {len(g['over_tol'])} over tol)")
        rows.extend(f"  note: {n}" for n in g["notes"])
        rows.append(f"{'AdamW step':<36}{a['max_abs']:>11.2e}{'':>11}{a['scaled']:>11.2e}  {mark(a['ok'])}  "
                    f"(lr {a['hyper']['lr']}, betas {tuple(a['hyper']['betas'])}, wd {a['hyper']['weight_decay']})")
    gen = report.get("generate")
    if gen and "skipped" not in gen:
        for c in ("cached", "uncached"):
            miss = gen[f"first_mismatch_{c}"]
            verdict = mark(miss is None) if gen["judged"] else "reported"
            what = gen[c] if isinstance(gen[c], str) else "" if miss is None else f"first mismatch at token {miss}"
            rows.append(f"{'greedy ' + c + ' vs torch':<36}{gen['new_tokens']:>11} new tokens  {verdict}"
                        + (f"  ({what})" if what else ""))
    bad = report["first_bad_layer"]
    rows.append("PASS" if report["ok"] else "FAIL" + (f": first layer above tolerance: layer {bad}"
                                                      if bad is not None else ""))
    return "\n".join(rows)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
