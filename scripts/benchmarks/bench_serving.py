"""Serving throughput: 32 ragged requests, all arriving at t=0, greedy, EOS ignored.

    .venv/bin/python -m scripts.benchmarks.bench_serving            # all arms -> results/engine/serving.{json,md}
    .venv/bin/python -m scripts.benchmarks.bench_serving --quick    # smoke: 8 requests, a tiny model
    .venv/bin/python -m scripts.benchmarks.bench_serving --arms engine serve
    .venv/bin/python -m scripts.benchmarks.bench_serving --arms hf-batch engine serve --isa avx2   # capped at AVX2

Workload (issue 22): a random 4-layer, 256-wide LLaMA in HF format (vocab 32000, 4 heads, context
256), saved locally; prompts of 8-96 tokens (uniform), output lengths from an exponential with
mean 48, capped at 160 (at least 1). Arms, each in its own subprocess (``harness.spawn``):
- hf-one:   transformers ``generate`` one request after another
- hf-batch: transformers' continuous batching (``init_continuous_batching``, paged attention;
            what ``generate_batch`` runs), each request with its own ``max_new_tokens``
- engine:   jaxgpt's Engine in-process (paged KV cache, continuous batching)
- serve:    ``python -m jaxgpt serve`` in its own process, 32 concurrent streams from one client process
            (``sse_events``: a lean asyncio client, as vLLM's benchmark_serving uses aiohttp)
- serve-openai: the same through the ``openai`` package's client, whose own CPU shares the 2 cores
Reported: requests/s, output tok/s, time to first token and time per output token (p50/p99),
compile/warm-up excluded (every arm first runs the workload's lengths once untimed, with other prompt
ids so that no prefix cache holds the timed prompts, then freezes its objects for the collector), and
whether each arm's tokens equal hf-one's (``identical``: requests whose tokens all match; ``prefix``: requests
whose shorter output is a prefix of the other's).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.harness import ISAS, RESULTS, LoadSampler, isa_env, report, spawn, timing_note, write_result

ARMS = ("hf-one", "hf-batch", "engine", "serve", "serve-openai")


def workload(n: int, seed: int = 0, vocab: int = 32000):
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, vocab, int(rng.integers(8, 97)))] for _ in range(n)]
    outs = [int(min(160, max(1, round(rng.exponential(48))))) for _ in range(n)]
    return prompts, outs


def fresh(prompts, seed: int = 1):
    """The warm-up's prompts: the same lengths (so the same compiled shapes), other ids, so that the
    timed run finds none of its prompts in a prefix cache the warm-up filled."""
    rng, top = np.random.default_rng(seed), max(max(p) for p in prompts) + 1
    return [[int(x) for x in rng.integers(3, top, len(p))] for p in prompts]


def settle() -> None:
    """After the warm-up, in every arm alike: collect, then freeze what exists (as ``jaxgpt serve`` does
    at start), so a full collection inside the timed run walks only the objects that run creates."""
    import gc

    gc.collect()
    gc.freeze()


def build_model(path: Path, quick: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = (LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256) if quick else
           LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = 2, 1, 0
    LlamaForCausalLM(cfg).eval().save_pretrained(path)


def _stats(starts, firsts, ends, counts, wall) -> dict:
    ttft = np.array(firsts) - np.array(starts)
    tpot = np.array([(e - f) / (c - 1) for f, e, c in zip(firsts, ends, counts) if c > 1])
    q = lambda a, p: float(np.percentile(a, p)) * 1000 if len(a) else None
    return dict(wall_s=wall, requests_per_s=len(counts) / wall, output_tok_per_s=sum(counts) / wall,
                ttft_ms_p50=q(ttft, 50), ttft_ms_p99=q(ttft, 99), tpot_ms_p50=q(tpot, 50), tpot_ms_p99=q(tpot, 99))


# ---------------------------------------------------------------- workers
def torch_model(path, device: str = "cpu", dtype: str = "float32"):
    """The saved HF model in ``dtype`` on ``device`` ('cpu', 'cuda'), for inference."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def run_hf_one(path, prompts, outs, warm=True, device="cpu", dtype="float32"):
    import torch
    from transformers.generation.streamers import BaseStreamer

    model = torch_model(path, device, dtype)

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def once():
        tokens, firsts, ends = [], [], []
        t0 = time.perf_counter()
        for p, n in zip(prompts, outs):
            clock = Clock()
            out = model.generate(torch.tensor([p], device=device), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, streamer=clock)
            tokens.append(out[0, len(p):].tolist())
            firsts.append(clock.times[1])  # times[0] is the prompt
            ends.append(time.perf_counter())
        return tokens, [t0] * len(prompts), firsts, ends, time.perf_counter() - t0

    if warm:  # allocator and kernels
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    settle()
    tokens, starts, firsts, ends, wall = once()
    return tokens, _stats(starts, firsts, ends, [len(t) for t in tokens], wall)


def run_hf_batch(path, prompts, outs, warm=True, device="cpu", dtype="float32", max_batch_tokens=None):
    """``max_batch_tokens``: tokens a step (None: transformers solves it from the free memory)."""
    from transformers import GenerationConfig

    model = torch_model(path, device, dtype)  # the manager switches to paged attention
    gc = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)

    # The same KV capacity as the engine's default (one full context per request). transformers' own CPU
    # default is 60% of RAM, zeroed inside the timed run when the manager starts (~14 GiB here: 5-40 s).
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    default = ContinuousBatchingConfig()  # its page is 'block_size' before transformers 5.2x, 'page_size' after
    page, ctx = getattr(default, "page_size", None) or default.block_size, model.config.max_position_embeddings
    cbc = ContinuousBatchingConfig(num_blocks=len(prompts) * -(-ctx // page), max_batch_tokens=max_batch_tokens)

    def once(prompts):
        manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
        manager.start()
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, outs)]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
        wall = time.perf_counter() - t0
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager() if hasattr(
            model, "destroy_cached_continuous_batching_manager") else None
        tokens = [list(results[i].generated_tokens) for i in ids]
        stamps = [getattr(results[i], "timestamps", None) or [] for i in ids]
        firsts = [s[0] if s else t0 + wall for s in stamps]
        ends = [s[-1] if s else t0 + wall for s in stamps]
        if firsts and firsts[0] > 1e12:  # timestamps in another clock: report throughput only
            firsts = ends = [t0 + wall] * len(ids)
        return tokens, _stats([t0] * len(ids), firsts, ends, [len(t) for t in tokens], wall)

    if warm:
        once(fresh(prompts))
    settle()
    return once(prompts)


def _engine(path, max_seqs, dtype="float32"):
    from jaxgpt.convert.hf import load_hf
    from jaxgpt.inference.engine import Engine

    config, params = load_hf(path, None if dtype == "float32" else dtype)  # on JAX's default device
    config = config.replace(dtype=dtype, param_dtype=dtype)
    return Engine(config, params, max_seqs=max_seqs, page_size=16, max_tokens_per_step=512)


def drain(engine, prompts, params) -> tuple[list[list[int]], float, list[float], list[float]]:
    """Every request added at once (``params``: one SamplingParams each), the engine stepped until all
    finish: (each request's tokens, the start time, each one's first-token and end times)."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    toks = {i: [] for i in ids}
    firsts, ends = {}, {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            toks[o.id] += o.new_token_ids
            firsts.setdefault(o.id, now)
            if o.finished:
                ends[o.id] = now
    return [toks[i] for i in ids], t0, [firsts[i] for i in ids], [ends[i] for i in ids]


def run_engine(path, prompts, outs, warm=True, dtype="float32"):
    from jaxgpt.inference.sampling import SamplingParams

    engine = _engine(path, len(prompts), dtype)

    def once(prompts):
        tokens, t0, firsts, ends = drain(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in outs])
        wall = time.perf_counter() - t0
        return tokens, _stats([t0] * len(tokens), firsts, ends, [len(t) for t in tokens], wall)

    if warm:  # compiles every bucket the workload reaches
        once(fresh(prompts))
    settle()
    tokens, stats = once(prompts)
    return tokens, dict(stats, compiled_shapes=engine.compilations, preemptions=engine.stats["preemptions"])


async def sse_events(port: int, path: str, body: dict):
    """POST ``body`` to the local server and yield each server-sent event's JSON: a lean HTTP/1.1 client on
    asyncio's streams, as vLLM's benchmark_serving drives a server with aiohttp. Why not the ``openai``
    client (the ``serve-openai`` arm): beside the server it measures, on this 2-core machine, its parsing
    took 0.5-0.8 s of CPU a run against this client's 0.25 s, and the server's throughput fell with it."""
    import asyncio
    import json

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    try:
        status = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if b" 200 " not in status:
            raise RuntimeError(f"{path}: {status.decode().strip()}: {(await reader.read(2000)).decode()}")
        chunked, buf = headers.get("transfer-encoding") == "chunked", b""
        while True:
            if chunked:  # (size in hex) CRLF (data) CRLF, ..., 0 CRLF CRLF
                size = int((await reader.readline()).strip(), 16)
                piece = (await reader.readexactly(size + 2))[:-2] if size else b""
            else:
                piece = await reader.read(1 << 16)
            if not piece:
                return
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    yield json.loads(event[6:])
    finally:
        writer.close()


def run_serve(path, prompts, outs, warm=True, client="lean"):
    """``python -m jaxgpt serve`` in its own process (as a deployment runs it), 32 concurrent streams from
    one client process: ``sse_events`` (``client='lean'``), or the ``openai`` package's (``'openai'``)."""
    import asyncio
    import socket
    import subprocess
    import urllib.request

    from scripts.harness import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxgpt", "serve", str(path), "--port", str(port),
                             "--max-seqs", str(len(prompts)), "--served-model-name", "bench"]
                            + ([] if warm else ["--no-precompile"]), cwd=ROOT)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"jaxgpt serve exited with {proc.returncode}") from None
                time.sleep(0.2)

        async def one_lean(p, n):
            start, first, ids = time.perf_counter(), None, []
            body = dict(model="bench", prompt=p, max_tokens=n, temperature=0, stream=True, ignore_eos=True,
                        return_token_ids=True)
            async for event in sse_events(port, "/v1/completions", body):
                for c in event["choices"]:
                    got = c.get("token_ids") or []
                    if got and first is None:
                        first = time.perf_counter()
                    ids += got
            return ids, start, first, time.perf_counter()

        async def one_openai(client, p, n):
            start, first, ids = time.perf_counter(), None, []
            stream = await client.completions.create(model="bench", prompt=p, max_tokens=n, temperature=0,
                                                     stream=True,
                                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                for c in chunk.choices:
                    got = (c.model_extra or {}).get("token_ids") or []
                    if got and first is None:
                        first = time.perf_counter()
                    ids += got
            return ids, start, first, time.perf_counter()

        async def once(prompts):
            if client == "lean":
                one = one_lean
            else:  # one client per event loop (its connection pool belongs to the loop)
                import openai

                sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
                one = functools.partial(one_openai, sdk)
            t0 = time.perf_counter()
            res = await asyncio.gather(*[one(p, n) for p, n in zip(prompts, outs)])
            wall = time.perf_counter() - t0
            tokens = [r[0] for r in res]
            return tokens, _stats([r[1] for r in res], [r[2] for r in res], [r[3] for r in res],
                                  [len(t) for t in tokens], wall)

        if warm:  # the server compiles the buckets the workload reaches
            asyncio.run(once(fresh(prompts)))
        settle()
        return asyncio.run(once(prompts))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def worker(arm, path, n, quick):
    prompts, outs = workload(n, vocab=512 if quick else 32000)
    fn = {"hf-one": run_hf_one, "hf-batch": run_hf_batch, "engine": run_engine, "serve": run_serve,
          "serve-openai": functools.partial(run_serve, client="openai")}[arm]
    # --quick is a smoke run of the pipeline (token identity, the report), not a timing: no warm-up rounds,
    # no precompilation (about half of its time in CI)
    tokens, stats = fn(path, prompts, outs, warm=not quick)
    report({"arm": arm, "tokens": tokens, **stats})


# ---------------------------------------------------------------- driver
def compare(a, b) -> tuple[int, int]:
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(x[:min(len(x), len(y))] == y[:min(len(x), len(y))] for x, y in zip(a, b))
    return same, prefix


def median_run(runs: list[dict]) -> dict:
    """An arm's row: its median-throughput run (the lower middle of an even count), with every run's tok/s;
    a failed run is the row when any failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["output_tok_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2], runs_tok_per_s=[r["output_tok_per_s"] for r in runs])


def table(rows, ref, note) -> str:
    lines = ["| arm | req/s | output tok/s (runs) | vs hf-one | vs hf-batch | TTFT p50 / p99 ms | "
             "TPOT p50 / p99 ms | tokens = hf-one |", "|---|---|---|---|---|---|---|---|"]
    by = {r["arm"]: r for r in rows if "error" not in r}
    f = lambda v: "-" if v is None else f"{v:.0f}"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('arm', '?')} | error: {r['error'][:80]} | | | | | | |")
            continue
        rel = lambda k: f"{r['output_tok_per_s'] / by[k]['output_tok_per_s']:.2f}x" if k in by else "-"  # noqa: B023 - called in this iteration
        same = r.get("identical", "not checked" if ref is None else "-")
        runs = r.get("runs_tok_per_s", [])
        spread = f" ({', '.join(f'{v:.0f}' for v in runs)})" if len(runs) > 1 else ""
        lines.append(f"| {r['arm']} | {r['requests_per_s']:.2f} | {r['output_tok_per_s']:.0f}{spread} | "
                     f"{rel('hf-one')} | {rel('hf-batch')} | {f(r['ttft_ms_p50'])} / {f(r['ttft_ms_p99'])} | "
                     f"{f(r['tpot_ms_p50'])} / {f(r['tpot_ms_p99'])} | {same} |")
    if ref is None:  # a table must not let a reader assume the tokens were compared
        note += (" Tokens not checked: no hf-one arm ran, so nothing here shows any arm's tokens equal "
                 "transformers' `generate`.")
    return "\n".join(lines) + f"\n\n{note}\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3,
                    help="every arm once a round, each in its own process, arms alternating; each arm's row is "
                         "its median-throughput run (--quick: 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "engine" / "serving.json"))
    ap.add_argument("--isa", choices=ISAS, default="native", help="cap torch, XLA and jaxgpt's kernels at this "
                    "instruction set in every worker and server (scripts/harness.py::isa_env)")
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "MODEL"))
    a = ap.parse_args(argv)
    n = 8 if a.quick and a.requests == 32 else a.requests
    if a.worker:
        return worker(a.worker[0], a.worker[1], n, a.quick)
    os.environ.update(isa_env(a.isa))  # the workers and the server they start inherit it
    load = LoadSampler()
    load.start()
    uptime_before = os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        build_model(path, a.quick)
        runs = {arm: [] for arm in a.arms}
        for _ in range(1 if a.quick else a.rounds):
            for arm in a.arms:
                args = ["--worker", arm, path, "--requests", n] + (["--quick"] if a.quick else [])
                r = spawn("scripts.benchmarks.bench_serving", *args, timeout=1800)
                r.setdefault("arm", arm)
                runs[arm].append(r)
                print(arm, {k: v for k, v in r.items() if k != "tokens"}, file=sys.stderr, flush=True)
        rows = [median_run(runs[arm]) for arm in a.arms]
    ref = next((r["tokens"] for r in rows if r.get("arm") == "hf-one" and "tokens" in r), None)
    for r in rows:
        if ref is not None and "tokens" in r:  # the worst of the arm's runs
            same, prefix = min(compare(x["tokens"], ref) for x in runs[r["arm"]] if "tokens" in x)
            r["identical"], r["prefix"] = f"{same}/{len(ref)}", f"{prefix}/{len(ref)}"
    note = (f"{n} requests; {1 if a.quick else a.rounds} round(s), arms alternating, each arm's median run; "
            f"instruction sets: {a.isa}; "
            f"{timing_note(load.record())}. uptime before: `{uptime_before}`; after: "
            f"`{os.popen('uptime').read().strip()}`.")
    result = {"rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows], "load": load.record(),
              "note": note}
    if not a.quick or a.out != str(RESULTS / "engine" / "serving.json"):
        write_result(a.out, result, table(rows, ref, note))
    else:
        print(table(rows, ref, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
