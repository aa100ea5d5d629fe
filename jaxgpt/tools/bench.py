"""Throughput of a decoder LM: the jitted train step and greedy decoding with and without the KV
cache, on the default JAX backend, optionally raced against the torch_ref mirror on the CPU.

Everything is built inside ``bench`` (nothing is allocated at import), so large presets can be
measured on a large machine. Numbers are wall-clock on random tokens: what a real run of the same
shapes would see, data loading excluded.
"""
from __future__ import annotations

import math
import time

import jax
import numpy as np

from jaxgpt.config import PRESETS, Execution, ModelConfig, TrainConfig, get_preset
from jaxgpt.core.timing import step_times
from jaxgpt.inference.generate import generate
from jaxgpt.models import count_params
from jaxgpt.train.step import init_state, make_train_step


def _preset_name(config) -> str | None:
    return next((k for k, v in PRESETS.items() if v == config), None)


def _best_seconds(fn, min_total: float = 0.5, max_calls: int = 5) -> float:
    """Best wall time of ``fn()`` (already warmed up) over 1..max_calls calls, stopping once
    ``min_total`` seconds have been spent: the minimum is the least noisy estimate on a shared
    machine, and slow configs are timed only once."""
    best, total, calls = math.inf, 0.0, 0
    while calls < max_calls and (calls == 0 or total < min_total):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, total, calls = min(best, dt), total + dt, calls + 1
    return best


def _random_tokens(seed: int, shape: tuple, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


def bench(config: ModelConfig | str, *, batch_size: int = 8, seq_len: int | None = None, steps: int = 10,
          prompt_len: int = 8, new_tokens: int = 64, decode_batch: int = 1, torch: bool = False,
          seed: int = 0, execution: Execution | None = None) -> dict:
    """Measure a decoder-only ``config`` (or preset name) and return a JSON-friendly dict.

    train: ``steps`` jitted train steps (TrainConfig defaults: AdamW + clipping + cosine lr) on
    (batch_size, seq_len) random tokens, after compiling and one warm-up step; ``train_tok_s`` =
    batch_size * seq_len * steps / seconds, ``train_ms_step``, ``compile_s`` (lower + compile).
    decode: greedy ``generate`` of ``new_tokens`` tokens for a (decode_batch, prompt_len) prompt,
    best of a few calls after a warm-up (compiling) call; tok/s = decode_batch * new_tokens / s.
    The cached figure is None for models without a KV cache (AttnRes residuals).
    torch=True adds the same measurements of torch_ref on the CPU as ``torch_*`` keys.
    ``execution``: the kernels, layer scan and precision measured (None: the default).
    """
    name = config if isinstance(config, str) else _preset_name(config)
    if isinstance(config, str):
        config = get_preset(config)
    if not isinstance(config, ModelConfig):
        kind = {"BertConfig": "a BertConfig (an encoder classifier)",
                "EncDecConfig": "an EncDecConfig (an encoder-decoder)"}.get(type(config).__name__,
                                                                            f"a {type(config).__name__}")
        raise ValueError(f"bench measures decoder language models; {name or 'this config'} is {kind}")
    seq_len = seq_len or min(config.max_len, 256)
    if seq_len > config.max_len:
        raise ValueError(f"seq_len={seq_len} exceeds the context window max_len={config.max_len}")
    if min(steps, prompt_len, new_tokens, decode_batch) < 1:
        raise ValueError(f"need steps, prompt_len, new_tokens, decode_batch >= 1, got {steps}, {prompt_len}, "
                         f"{new_tokens}, {decode_batch}")
    if prompt_len + new_tokens > config.max_len:  # otherwise generate silently drops the cache
        raise ValueError(f"prompt_len + new_tokens = {prompt_len} + {new_tokens} = {prompt_len + new_tokens} "
                         f"exceeds max_len={config.max_len}; the KV cache needs the whole sequence to fit")
    tc = TrainConfig(batch_size=batch_size, seq_len=seq_len, steps=steps + 1, seed=seed,
                     execution=Execution.for_model(config, execution))
    # One (T+1)-token window per row gives inputs and shifted targets, like the LM data pipeline.
    windows = _random_tokens(seed, (steps + 1, 1, batch_size, seq_len + 1), config.vocab_size)
    # Batches go to the device before the clock starts: the step is measured, not the transfer.
    batches = [{"x": w[:, :, :-1], "y": w[:, :, 1:]} for w in windows]  # (1, B, T): one micro-batch
    device_batches = [jax.tree.map(jax.device_put, b) for b in batches]
    prompt = _random_tokens(seed + 1, (decode_batch, prompt_len), config.vocab_size)

    state = init_state(config, tc)
    n_params = count_params(state.params)
    t = time.perf_counter()
    # Compiled ahead so compile time is reported apart from the warm-up step's run time.
    step = make_train_step(config, tc).lower(state, device_batches[0]).compile()
    compile_s = time.perf_counter() - t
    # no sync inside the loop (overlap): dispatch overlaps compute, as in training
    state, metrics, (step_s,) = step_times(step, state, device_batches, sync=jax.block_until_ready, overlap=True)
    train_s = step_s * steps
    params = state.params
    del state, device_batches  # free the optimizer moments before decoding (big presets)

    result = {"preset": name, "config": config.to_dict(), "execution": tc.execution.to_dict(), "backend": jax.default_backend(),
              "device": str(jax.devices()[0]), "params": n_params, "batch_size": batch_size,
              "seq_len": seq_len, "steps": steps, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "decode_batch": decode_batch, "train_tok_s": batch_size * seq_len * steps / train_s,
              "train_ms_step": 1e3 * train_s / steps, "compile_s": compile_s,
              "final_loss": float(metrics["loss"])}
    has_cache = config.residual == "standard"  # generate() decodes AttnRes models without a cache
    for key, use_cache in (("decode_cached_tok_s", True), ("decode_uncached_tok_s", False)):
        if use_cache and not has_cache:
            result[key] = None
            continue
        run = lambda: jax.block_until_ready(generate(config, params, prompt, new_tokens, use_cache=use_cache,  # noqa: B023 - called in this iteration
                                                     execution=tc.execution))
        run()  # compiles this (shape, cache) variant
        result[key] = decode_batch * new_tokens / _best_seconds(run)
    params = None  # drop jaxgpt's weights before torch builds its own copy (big presets)
    if torch:
        result.update(_bench_torch(config, tc, batches, prompt, new_tokens, seed, has_cache))
    return result


def _bench_torch(config: ModelConfig, tc: TrainConfig, batches: list[dict], prompt: np.ndarray, new_tokens: int,
                 seed: int, has_cache: bool) -> dict:
    """The same measurements for torch_ref (eager, float32, CPU, default thread count): its
    training loop (torch_ref.train) with the same optimizer settings on the same batches."""
    import torch  # lazily: jaxgpt itself does not depend on torch

    import torch_ref
    from torch_ref.generate import generate as torch_generate
    from torch_ref.train import make_optimizer, train_step

    torch.manual_seed(seed)
    model = torch_ref.build(config).float()
    opt, sched = make_optimizer(model, tc)
    steps = len(batches) - 1  # the first is the warm-up: allocator, AdamW state creation
    _, metrics, (step_s,) = step_times(lambda _, b: (None, train_step(model, opt, sched, tc, b)), None, batches,
                                       overlap=True)
    train_s = step_s * steps
    out = {"torch_version": torch.__version__, "torch_device": "cpu", "torch_threads": torch.get_num_threads(),
           "torch_train_tok_s": tc.batch_size * tc.seq_len * steps / train_s,
           "torch_train_ms_step": 1e3 * train_s / steps, "torch_final_loss": metrics["loss"]}
    tp = torch.from_numpy(prompt).long()
    for key, use_cache in (("torch_decode_cached_tok_s", True), ("torch_decode_uncached_tok_s", False)):
        if use_cache and not has_cache:
            out[key] = None
            continue
        run = lambda: torch_generate(model, tp, new_tokens, use_cache=use_cache)  # noqa: B023 - called in this iteration
        run()
        out[key] = prompt.shape[0] * new_tokens / _best_seconds(run)
    return out


def format_table(result: dict) -> str:
    """A small aligned text table of a ``bench`` result: tok/s per row, one column per framework
    (torch and the jaxgpt/torch ratio only when the result has torch numbers)."""
    rows = [("train step", "train_tok_s"), ("decode (KV cache)", "decode_cached_tok_s"),
            ("decode (no cache)", "decode_uncached_tok_s")]
    has_torch = "torch_train_tok_s" in result
    header = ["tok/s", "jaxgpt"] + (["torch", "jaxgpt/torch"] if has_torch else [])

    def num(v):
        return "n/a" if v is None else f"{v:,.0f}"

    lines = [header]
    for label, key in rows:
        jv, tv = result.get(key), result.get("torch_" + key)
        line = [label, num(jv)]
        if has_torch:
            line += [num(tv), "n/a" if not (jv and tv) else f"{jv / tv:.2f}x"]
        lines.append(line)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    title = (f"{result.get('preset') or 'config'}: {result['params']:,} params, {result['backend']} "
             f"({result['device']}); train {result['batch_size']}x{result['seq_len']}, "
             f"{result['train_ms_step']:.1f} ms/step, compile {result['compile_s']:.1f}s; "
             f"decode {result['decode_batch']}x({result['prompt_len']}+{result['new_tokens']})")
    body = [fmt(r) for r in lines]
    return "\n".join([title, body[0], "-" * len(body[0])] + body[1:])
