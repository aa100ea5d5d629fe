"""Loading and saving a Hugging Face checkpoint: jaxgpt's load_hf / save_hf against transformers.

    .venv/bin/python -m scripts.benchmarks.bench_load                  # 0.85B -> results/load/llama_0.85b.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_load --shape 7b --rounds 1 --arms load_hf
    .venv/bin/python -m scripts.benchmarks.bench_load --shape tiny --rounds 1 --dir /tmp/bl   # smoke

Checkpoint: a LLaMA built by transformers from a config (``SHAPES``), its weights filled cheaply (one
random bf16 block repeated), saved in bf16 by ``save_pretrained`` in ``--shard`` shards under
``--dir`` (never the repository), deleted at the end unless ``--keep``. Each arm runs in its own
fresh interpreter (``harness.spawn``), the arms alternating A B A B for ``--rounds`` rounds:

- load_hf: ``jaxgpt.convert.load_hf(dir, dtype='bfloat16')`` (NumPy params, every weight copied);
  on request, load_hf_float32: ``load_hf(dir)`` (the default, bf16 upcast to float32);
- from_pretrained: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``;
- save_hf / save_pretrained: the model loaded as above, then written (same shard size) to a new dir.

Reported: wall time of the call, MB/s (checkpoint bytes / time), the process's peak resident
memory (VmHWM; reset before a save, so a save's peak is its own) and the resident memory before
the call; the ratio of peak to the checkpoint's bytes; the call's CPU time (user + system): when
other jobs share the cores, the part of the wall time that was the call's own work. The
checkpoint's files are in the page cache (just written or read), as for every arm alike.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

from scripts.harness import RESULTS, LoadSampler, report, spawn, timing_note, write_result

SHAPES = {  # LlamaConfig fields
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=32000),
    "0.85b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=5632, vocab_size=32000),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=32000),
}
ARMS = ("load_hf", "from_pretrained", "save_hf", "save_pretrained")
EXTRA_ARMS = ("load_hf_float32",)  # on request (--arms): load_hf's default, bf16 upcast to float32
GIB = 2**30


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _cpu() -> float:
    """This process's CPU seconds (user + system): what the call costs on a core of its own."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def generate(out: str, shape: str, shard: str) -> None:
    """Worker: a bf16 LLaMA with cheap pseudo-random weights, saved by transformers' save_pretrained."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # allocated in bf16 only: 2 bytes a weight
    block = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            flat, n = p.view(-1), p.numel()
            for i in range(0, n, block.numel()):
                flat[i:i + block.numel()].copy_(block[:n - i])
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, max_shard_size=shard)
    report({"params": sum(p.numel() for p in model.parameters())})


def run_arm(arm: str, src: str, out: str, shard: str) -> None:
    """Worker: one timed arm (see the module docstring)."""
    if arm in ("load_hf", "save_hf", "load_hf_float32"):
        import jax

        from jaxgpt.convert import load_hf, save_hf

        jax.numpy.zeros(1).block_until_ready()  # backend up before the clock starts
        rss, cpu = _status("VmRSS"), _cpu()
        t = time.perf_counter()
        config, params = load_hf(src, dtype=None if arm == "load_hf_float32" else "bfloat16")
        seconds, cpu = time.perf_counter() - t, _cpu() - cpu
        nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
        if arm == "save_hf":
            rss, cpu = _status("VmRSS"), _cpu()
            _reset_peak()
            t = time.perf_counter()
            save_hf(out, config, params, max_shard_size=shard)
            seconds, cpu = time.perf_counter() - t, _cpu() - cpu
    else:
        import torch
        import transformers

        rss, cpu = _status("VmRSS"), _cpu()
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        seconds, cpu = time.perf_counter() - t, _cpu() - cpu
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if arm == "save_pretrained":
            rss, cpu = _status("VmRSS"), _cpu()
            _reset_peak()
            t = time.perf_counter()
            model.save_pretrained(out, max_shard_size=shard)
            seconds, cpu = time.perf_counter() - t, _cpu() - cpu
    report({"seconds": seconds, "cpu_seconds": cpu, "peak": _status("VmHWM"), "rss_before": rss, "param_bytes": nbytes})


def _bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def table(result: dict) -> str:
    size = result["checkpoint_bytes"]
    lines = [f"LLaMA {result['shape']} ({result['params'] / 1e9:.2f}B params), bf16, {result['shards']} shards, "
             f"{size / GIB:.2f} GiB; {result['rounds']} rounds A B A B, medians; {result['note']}; "
             f"load average before {result['load_before']:.2f}, after {result['load_after']:.2f}.", "",
             "| arm | seconds | MB/s | CPU seconds | MB/s of CPU time | peak RSS GiB | RSS before GiB | "
             "peak / checkpoint | (peak - before) / checkpoint |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        lines.append(f"| {arm} | {r['seconds']:.2f} | {size / 1e6 / r['seconds']:.0f} | {r['cpu_seconds']:.2f} | "
                     f"{size / 1e6 / r['cpu_seconds']:.0f} | {r['peak'] / GIB:.2f} | "
                     f"{r['rss_before'] / GIB:.2f} | {r['peak'] / size:.2f} | {(r['peak'] - r['rss_before']) / size:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.85b")
    ap.add_argument("--dir", default="/work/bench-load", help="where the checkpoints are generated (not the repo)")
    ap.add_argument("--shard", default="500MB", help="max_shard_size of every saved checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS + EXTRA_ARMS}")
    ap.add_argument("--out", default=None, help="default results/load/llama_<shape>.json")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    a = ap.parse_args(argv)
    arms = a.arms.split(",")
    base = Path(a.dir) / f"llama-{a.shape}"
    src = base / "src"
    if not (src / "config.json").is_file():
        shutil.rmtree(base, ignore_errors=True)
        gen = spawn("scripts.benchmarks.bench_load", "--worker", "generate", src, a.shape, a.shard, check=True)
    else:
        gen = {"params": None}
    sampler = LoadSampler()
    sampler.start()
    load_before = os.getloadavg()[0]
    runs: dict[str, list] = {arm: [] for arm in arms}
    try:
        for r in range(a.rounds):
            for arm in arms:
                out = base / f"out-{arm}"
                shutil.rmtree(out, ignore_errors=True)
                res = spawn("scripts.benchmarks.bench_load", "--worker", arm, src, out, a.shard, check=True)
                shutil.rmtree(out, ignore_errors=True)
                print(f"round {r} {arm}: {res}", file=sys.stderr, flush=True)
                runs[arm].append(res)
        size = _bytes(src)
        params = gen["params"] or runs[arms[0]][0]["param_bytes"] // 2
        result = {"shape": a.shape, "config": SHAPES[a.shape], "params": params, "checkpoint_bytes": size,
                  "shards": len(list(src.glob("*.safetensors"))), "rounds": a.rounds,
                  "load_before": load_before, "load_after": os.getloadavg()[0], "load": sampler.record(),
                  "note": timing_note(sampler.record()), "runs": runs,
                  "arms": {arm: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for arm, rs in runs.items()}}
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    write_result(a.out or RESULTS / "load" / f"llama_{a.shape}.json", result, table(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        kind, *args = sys.argv[2:]
        generate(*args) if kind == "generate" else run_arm(kind, *args)
    else:
        main()
