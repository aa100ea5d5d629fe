"""The processes of scripts/benchmarks/profile_step.py, one (framework, setting) each: a jaxgpt train step
under jax.profiler, torch_ref's under torch.profiler, and the prototype variants of the jaxgpt step
(code here, library untouched) timed for the A/B race. Spawned by the driver:

    python -m scripts.benchmarks.profile_workers --worker jax:jaxgpt-default --shape quick --steps 2 ...
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from scripts.benchmarks import bench_train as bt  # SHAPES, JAX_SETTINGS, batches (imports no framework)
from scripts.benchmarks.profile_ops import (classify_hlo, jax_category, per_op_summary, summarise, thunk_self_times,
                                            torch_category)
from scripts.harness import matmul_peak, parse_hlo, report, single_thread, step_times

# untimed steps every process runs first
WARMUP = {"cpu-small": 2, "shakespeare-char": 1, "quick": 2}


def _jax_state(shape: str, setting: str, variant: str | None = None):
    config, batch, seq_len, _ = bt.SHAPES[shape]
    chosen = json.loads(setting) if setting.startswith("{") else bt.JAX_SETTINGS[setting]
    devices = chosen.get("host_devices", 1)
    from jaxgpt.parallel.sharding import use_host_devices
    use_host_devices(devices)
    import jax

    from jaxgpt.config import TrainConfig
    from jaxgpt.train.step import make_train_step
    if variant:
        apply_variant(variant)
    config = config.replace(**chosen.get("config", {}))
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=1000)
    return config, tc, devices, jax, make_train_step


def worker_jax(shape: str, setting: str, steps: int, time_steps: int, peak_n: int) -> dict:
    config, tc, devices, jax, make_train_step = _jax_state(shape, setting)
    warm = WARMUP[shape]
    batches = bt.random_batches(config, tc.batch_size, tc.seq_len, warm + time_steps + steps)
    tc, mesh, state, batches = bt.placed(config, tc, batches, devices)
    peak = matmul_peak("jax", peak_n)
    compiled = make_train_step(config, tc, mesh=mesh).lower(state, batches[0]).compile()
    info = classify_hlo(parse_hlo(compiled.as_text()))
    state, metrics, times = step_times(compiled, state, batches[:warm + time_steps], warm=warm,
                                       sync=jax.block_until_ready)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for i, b in enumerate(batches[warm + time_steps:]):
                with jax.profiler.TraceAnnotation(f"pstep{i}"):
                    state, metrics = compiled(state, b)
                    jax.block_until_ready(metrics)
        wall = (time.perf_counter() - t) / steps
        path = next(Path(d).rglob("*.xplane.pb"))
        per_op = per_op_summary(thunk_self_times(str(path)), steps)
    unknown = {"kind": "other", "phase": "opt", "flops": 0.0, "batched": False}
    summary = summarise(per_op, lambda op: jax_category(info.get(op, unknown)))
    kinds = collections.Counter()
    matmul_flops = {"projection": 0.0, "attention": 0.0}
    for op, v in per_op.items():
        i = info.get(op, unknown)
        kinds[i["kind"] + "/" + i["phase"]] += v["mean_ms"]
        if i["kind"] == "matmul":  # FLOPs of the dots that ran, times how often per step
            matmul_flops["attention" if i["batched"] else "projection"] += i["flops"] * v["n"]
    return {"framework": "jax", "jax_version": jax.__version__, "setting": setting, **summary,
            "kinds_ms": dict(kinds), "profiled_wall_ms": 1e3 * wall, "step_ms": 1e3 * statistics.median(times),
            "matmul_flops": matmul_flops, "peak_gflops": peak, "loss": float(metrics["loss"]),
            "n_ops": sum(v["n"] for v in per_op.values())}



def _torch_step(model, opt, sched, tc, batch, record):
    """torch_ref.train.train_step (grad_accum 1), with record_function labels per phase."""
    import torch
    from torch.profiler import record_function

    from torch_ref.train import loss_terms
    ctx = record_function if record else (lambda name: __import__("contextlib").nullcontext())
    model.train()
    opt.zero_grad(set_to_none=True)
    with ctx("phase:fwd"):
        terms = loss_terms(model, {k: v[0] for k, v in batch.items()})
    with ctx("phase:bwd"):
        terms["loss_sum"].backward()
    count = max(terms["count"].item(), 1)
    with ctx("phase:clip"):
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= count
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    with ctx("phase:opt"):
        opt.step()
        sched.step()
    return terms["loss_sum"].item() / count


def worker_torch(shape: str, steps: int, time_steps: int, peak_n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import torch_ref
    from jaxgpt.config import TrainConfig
    from torch_ref.train import make_optimizer, train_step
    config, batch, seq_len, _ = bt.SHAPES[shape]
    tc = TrainConfig(batch_size=batch, seq_len=seq_len, steps=1000)
    torch.manual_seed(0)
    model = torch_ref.build(config).float()
    opt, sched = make_optimizer(model, tc)
    warm = WARMUP[shape]
    batches = bt.random_batches(config, batch, seq_len, warm + time_steps + steps)
    peak = matmul_peak("torch", peak_n)
    # the library's step, unprofiled
    _, _, times = step_times(lambda _, b: (None, train_step(model, opt, sched, tc, b)), None,
                             batches[:warm + time_steps], warm=warm)
    t = time.perf_counter()
    from torch.profiler import record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, b in enumerate(batches[warm + time_steps:]):
            with record_function(f"pstep{i}"):
                loss = _torch_step(model, opt, sched, tc, b, record=True)
    wall = (time.perf_counter() - t) / steps
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        phase, step, p = None, -1, ev
        while p is not None:
            if phase is None and p.name.startswith("phase:"):
                phase = p.name[6:]
            elif phase is None and p.name.startswith("autograd::engine"):
                phase = "bwd"
            elif phase is None and p.name.startswith("Optimizer.step"):
                phase = "opt"
            m = re.fullmatch(r"pstep(\d+)", p.name)
            if m:
                step = int(m.group(1))
                break
            p = p.cpu_parent
        if ev.name.startswith(("phase:", "pstep")):
            phase = phase or "fwd"
        key = (ev.name, torch_category(ev.name, phase or "fwd"))
        per[(key, step)][0] += 1e3 * ev.self_cpu_time_total  # us -> ns
        per[(key, step)][1] += 1
    per_op = per_op_summary(per, steps)
    summary = summarise(per_op, lambda key: key[1])
    for o in summary["top_ops"]:
        o["op"] = o["op"].split("'")[1] if o["op"].startswith("(") else o["op"]
    return {"framework": "torch", "torch_version": torch.__version__, "threads": torch.get_num_threads(), **summary,
            "profiled_wall_ms": 1e3 * wall, "step_ms": 1e3 * statistics.median(times), "peak_gflops": peak,
            "loss": loss, "n_params": sum(p.numel() for p in model.parameters()),
            "n_ops": sum(v["n"] for v in per_op.values())}


# ---------------------------------------------------------------- variants (prototypes, library untouched)

VARIANTS = {
    "headmajor": "q/k/v projected by einsum straight to (B, H, T, D) (kernels viewed as (d, H, D)), attention "
                 "core on head-major tensors, o_proj by einsum from (B, H, T, D): no token/head-major copies",
    "fused-qkv": "q, k, v kernels concatenated into one (d, 3 d) matmul (split views of the same params)",
    "gelu-erf": "exact GELU written with erf, 0.5 x (1 + erf(x / sqrt 2)), instead of jax.nn.gelu(approximate=False) "
                "(erfc, which XLA:CPU expands into exp + selects)",
}


def apply_variant(name: str) -> None:
    """Monkeypatch jaxgpt in THIS process with the prototypes named in ``name`` ('+'-joined VARIANTS
    keys). Attention variants replace Attention.__call__ (same params, same math) on the plain training
    path (no cache, no RoPE, no mask, no dropout); gelu-erf replaces jaxgpt.nn.mlp.ACTIVATIONS['gelu']."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.nn import attention as A
    from jaxgpt.nn import mlp
    parts = name.split("+")
    if "gelu-erf" in parts:
        mlp.ACTIVATIONS["gelu"] = lambda x: 0.5 * x * (1.0 + jax.lax.erf(x * (2.0 ** -0.5)))
    name = next((p for p in parts if p in ("headmajor", "fused-qkv")), None)
    if name is None:
        return
    orig = A.Attention.__call__

    def call(self, x, context=None, *, mask=None, is_causal=False, positions=None, cache=None,
             return_weights=False, deterministic=True):
        plain = (context is None and mask is None and cache is None and not return_weights and not self.rope
                 and not self.qkv_bias and not self.o_bias and (deterministic or self.attn_dropout == 0.0)
                 and (self.n_kv_head or self.n_head) == self.n_head and self.attention_impl == "xla")
        if not plain:
            return orig(self, x, context, mask=mask, is_causal=is_causal, positions=positions, cache=cache,
                        return_weights=return_weights, deterministic=deterministic)
        h, d_model = self.n_head, self.d_model
        d = d_model // h
        b, t, _ = x.shape
        if self.is_initializing():
            return orig(self, x, context, mask=mask, is_causal=is_causal, positions=positions, cache=cache,
                        return_weights=return_weights, deterministic=deterministic)
        wq = self.variables["params"]["q_proj"]["kernel"]
        wk = self.variables["params"]["k_proj"]["kernel"]
        wv = self.variables["params"]["v_proj"]["kernel"]
        wo = self.variables["params"]["o_proj"]["kernel"]
        x2 = x.reshape(b * t, d_model)
        if name == "fused-qkv":
            qkv = x2 @ jnp.concatenate([wq, wk, wv], axis=1)  # (N, 3 d)
            q, k, v = (a.reshape(b, t, h, d) for a in jnp.split(qkv, 3, axis=1))
            out = A.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            y = out.reshape(b * t, d_model) @ wo
            return y.reshape(b, t, d_model), None, None
        # head-major
        xx = x
        q = jnp.einsum("btc,chd->bhtd", xx, wq.reshape(d_model, h, d))
        k = jnp.einsum("btc,chd->bhtd", xx, wk.reshape(d_model, h, d))
        v = jnp.einsum("btc,chd->bhtd", xx, wv.reshape(d_model, h, d))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
        if is_causal:
            s = jnp.where(A.causal_mask(t, t), s, jnp.finfo(jnp.float32).min)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", w.astype(v.dtype), v)
        y = jnp.einsum("bhtd,hdc->btc", o, wo.reshape(h, d, d_model))
        return y, None, None

    A.Attention.__call__ = call


def worker_variant(shape: str, setting: str, variant: str, steps: int) -> dict:
    """Time ``steps`` steps of the jaxgpt step (variant 'library' = unpatched); return the step times,
    the loss and grad-norm trajectory and the final params' checksum (for identical numerics)."""
    config, tc, devices, jax, make_train_step = _jax_state(shape, setting, None if variant == "library" else variant)
    import numpy as np
    tc, mesh, state, batches = bt.placed(config, tc, bt.random_batches(config, tc.batch_size, tc.seq_len, steps + 2),
                                         devices)
    compiled = make_train_step(config, tc, mesh=mesh).lower(state, batches[0]).compile()
    metrics = []

    def step(state, b):
        state, m = compiled(state, b)
        metrics.append(m)
        return state, m

    state, _, times = step_times(step, state, batches, warm=2, sync=jax.block_until_ready)
    losses = [[float(m["loss"]), float(m["grad_norm"])] for m in metrics]
    flat = np.concatenate([np.asarray(a).ravel() for a in jax.tree.leaves(state.params)])
    return {"times_s": times, "losses": losses, "param_sum": float(np.abs(flat).sum()),
            "params_head": flat[:2000].tolist()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="jax:<setting>, torch:eager or variant:<variant>:<setting>")
    ap.add_argument("--shape", default="quick")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps")
    ap.add_argument("--time-steps", type=int, default=2, help="unprofiled timed steps")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, choices=(0, 1))
    args = ap.parse_args(argv)
    if args.threads == 1:
        single_thread()
    kind, _, setting = args.worker.partition(":")
    if kind == "jax":
        out = worker_jax(args.shape, setting, args.steps, args.time_steps, args.peak_n)
    elif kind == "torch":
        out = worker_torch(args.shape, args.steps, args.time_steps, args.peak_n)
    else:  # variant:<variant>:<setting>
        variant, _, setting = setting.partition(":")
        out = worker_variant(args.shape, setting, variant, args.time_steps)
    report(out)


if __name__ == "__main__":
    main()
