"""``jaxgpt serve``'s app on a real uvicorn server (a thread, a free port), driven by the official
``openai`` client. Reference the test did not compute: transformers' greedy ``generate`` on the
same HF directory, each request alone; greedy token ids must be identical.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from argparse import Namespace

import numpy as np
import pytest
import torch

from conftest import require_module

pytestmark = pytest.mark.e2e  # a real uvicorn server: make test-slow

openai = require_module("openai", allow_module_level=True)
require_module("fastapi", allow_module_level=True)
require_module("uvicorn", allow_module_level=True)

VOCAB, CTX = 320, 64  # byte-level BPE needs 257+ tokens
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from parity_tests.hf_dirs import bpe_tokenizer, randomize_, save_tokenizer

    path = tmp_path_factory.mktemp("serve") / "tiny-llama"
    torch.manual_seed(1)
    model = randomize_(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CTX, bos_token_id=1, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False)), seed=1)
    model.save_pretrained(path)
    save_tokenizer(bpe_tokenizer(vocab=VOCAB), path, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path, model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(path, **kw):
    from jaxgpt.cli.serve import build_engine, chat_template_of
    from jaxgpt.inference.server import create_app

    args = Namespace(model=str(path), max_seqs=kw.get("max_seqs", 8), page_size=16, num_pages=kw.get("num_pages"),
                     max_tokens_per_step=32, kv_dtype="auto", draft=kw.get("draft"), num_speculative_tokens=3,
                     served_model_name=None)
    engine, tok, name = build_engine(args)
    app = create_app(engine, tokenizer=tok, model_name=name, chat_template=chat_template_of(str(path)),
                     max_waiting=kw.get("max_waiting", 256))
    server, thread, url = start(app)
    return server, thread, engine, url


def start(app):
    """``app`` on a uvicorn server in a thread, on a free port: (server, thread, url), once it accepts.
    Stop it with ``server.should_exit = True; thread.join()``."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(model_dir):
    server, thread, engine, url = _serve(model_dir[0])
    yield url, engine
    server.should_exit = True
    thread.join(timeout=10)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _raw(url, path, body: bytes | None = None):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def _metrics(url) -> dict[str, float]:
    text = _raw(url, "/metrics")[1]
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _ragged_greedy_matches_hf(url, model, n_requests):
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, VOCAB, int(rng.integers(1, 24)))] for _ in range(n_requests)]
    news = [int(rng.integers(1, 30)) for _ in prompts]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    name = _client(url).models.list().data[0].id

    async def one(i, p, n):
        extra = {"ignore_eos": True, "return_token_ids": True}
        if i % 2:  # half streamed: the token ids arrive in the chunks
            ids = []
            stream = await client.completions.create(model=name, prompt=p, max_tokens=n, temperature=0, stream=True,
                                                     extra_body=extra)
            async for chunk in stream:
                for c in chunk.choices:
                    ids += (c.model_extra or {}).get("token_ids") or []
            return ids
        r = await client.completions.create(model=name, prompt=p, max_tokens=n, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == n
        return r.choices[0].model_extra["token_ids"]

    async def all_():
        return await asyncio.gather(*[one(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))])

    got = asyncio.run(all_())
    want = [_hf_greedy(model, p, n) for p, n in zip(prompts, news)]
    assert got == want


def test_32_ragged_requests_in_flight_identical_to_hf(model_dir, server):
    _ragged_greedy_matches_hf(server[0], model_dir[1], 32)


@pytest.mark.slow  # a second server, with a draft model
def test_serve_with_a_draft_is_identical_to_hf_and_reports_acceptance(model_dir, tmp_path):
    """``--draft``: the target's first layer alone as the draft (the same vocabulary, a different
    model), so proposals are sometimes accepted; greedy tokens stay transformers'."""
    from transformers import LlamaForCausalLM

    draft_dir = tmp_path / "draft"
    draft = LlamaForCausalLM.from_pretrained(model_dir[0], num_hidden_layers=1)
    draft.save_pretrained(draft_dir)
    server, thread, engine, url = _serve(model_dir[0], draft=str(draft_dir))
    try:
        _ragged_greedy_matches_hf(url, model_dir[1], 12)
        m = _metrics(url)
        assert engine.draft is not None and engine.stats["spec_proposed"] > 0
        # the rate /metrics reports is the engine's; how many rounds ran (and so whether one was rejected)
        # depends on how the 12 streams overlapped and on the auto rule's measurements (speculation is off
        # where it measured a loss): once all were accepted (CI, 2026-11-27). Rejections are
        # test_engine_speculative.py's.
        stats = engine.stats
        assert m["jaxgpt_spec_acceptance_rate"] == pytest.approx(stats["spec_accepted"] / stats["spec_proposed"])
        assert 0 < m["jaxgpt_spec_acceptance_rate"] <= 1
        assert m["jaxgpt_spec_rounds_total"] == stats["spec_rounds"] > 0
        assert m["jaxgpt_spec_off_steps_total"] == stats["spec_off_steps"]
        est = engine.spec_policy.estimates()  # the default auto rule's state, one labelled sample a rows bucket
        assert m["jaxgpt_spec_alpha"] == pytest.approx(est["alpha"]) and 0 < est["alpha"] <= 1
        assert est["buckets"], est  # call times were measured
        for b, e in est["buckets"].items():
            for name, key in (("jaxgpt_spec_round_seconds", "t_spec"), ("jaxgpt_decode_step_seconds", "t_plain")):
                assert m.get(f'{name}{{rows="{b}"}}') == (None if e[key] is None else pytest.approx(e[key]))
            assert m.get(f'jaxgpt_spec_on{{rows="{b}"}}') == (None if e["wins"] is None else int(e["wins"]))
        assert m["jaxgpt_kv_pages_free"] == m["jaxgpt_kv_pages_total"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_text_chat_models_health_metrics(server):
    url, engine = server
    c = _client(url)
    assert _raw(url, "/health")[0] == 200
    name = c.models.list().data[0].id
    assert name == "tiny-llama"
    r = c.completions.create(model=name, prompt="the cat", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert isinstance(r.choices[0].text, str) and r.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=name, prompt="the cat", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices)
    assert streamed == r.choices[0].text
    chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0)
    assert chat.choices[0].message.role == "assistant"
    m = _metrics(url)
    for key in ("jaxgpt_kv_pages_free", "jaxgpt_kv_pages_total", "jaxgpt_requests_running",
                "jaxgpt_requests_waiting", "jaxgpt_generation_tokens_per_second"):
        assert key in m
    assert m["jaxgpt_kv_pages_free"] == m["jaxgpt_kv_pages_total"] == engine.allocator.total
    assert m["jaxgpt_prompt_tokens_total"] == engine.stats["prompt_tokens"] > 0


BAD = [
    (b"{not json", "not valid JSON", None),
    (json.dumps({"model": "tiny-llama", "prompt": [5], "max_tokens": 0}).encode(), "max_tokens must be >= 1",
     "max_tokens"),
    (json.dumps({"model": "tiny-llama", "prompt": [5, VOCAB]}).encode(), "outside the vocabulary", "prompt"),
    (json.dumps({"model": "tiny-llama", "prompt": [5] * CTX}).encode(), "context is 64", "prompt"),
    (json.dumps({"model": "gpt-9", "prompt": [5]}).encode(), "does not exist", "model"),
    (json.dumps({"model": "tiny-llama", "prompt": [5], "temperature": -1}).encode(), "temperature must be >= 0",
     "temperature"),
]


def test_overload_cancel_and_bad_requests_leave_every_page_free(server):
    """48 concurrent streams, 10 of them cancelled mid-stream, and the six bad requests: every bad
    answer is a 4xx with OpenAI's error body, every page is free afterwards, and the server still answers."""
    url, engine = server
    for body, msg, param in BAD:
        status, text, _ = _raw(url, "/v1/completions", body)
        assert 400 <= status < 500, (status, text)
        err = json.loads(text)["error"]
        assert msg in err["message"] and err["param"] == param and set(err) == {"message", "type", "param", "code"}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def stream(i):
        s = await client.completions.create(model="tiny-llama", prompt=[3 + i % 50] * (1 + i % 9), max_tokens=40,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for _ in s:
            n += 1
            if i < 10 and n == 3:
                await s.close()  # the client goes away mid-stream
                return None
        return n

    async def all_():
        return await asyncio.gather(*[stream(i) for i in range(48)])

    counts = asyncio.run(all_())
    assert all(c is None for c in counts[:10]) and all(c == 40 for c in counts[10:]), counts  # a chunk per token
    for _ in range(100):
        if engine.allocator.free == engine.allocator.total and not engine.has_unfinished():
            break
        time.sleep(0.05)
    assert engine.allocator.free == engine.allocator.total and not engine.has_unfinished()
    assert _metrics(url)["jaxgpt_kv_pages_free"] == engine.allocator.total
    r = _client(url).completions.create(model="tiny-llama", prompt=[5, 6], max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


@pytest.mark.slow  # a second server and 12 competing requests: ~13 s
def test_queue_full_is_429_and_a_failing_request_fails_alone(model_dir, monkeypatch):
    server, thread, engine, url = _serve(model_dir[0], max_seqs=4, max_waiting=1)  # the shapes compiled above
    try:
        body = json.dumps({"prompt": [5, 6], "max_tokens": 30, "temperature": 0, "ignore_eos": True}).encode()
        results = []
        threads = [threading.Thread(target=lambda: results.append(_raw(url, "/v1/completions", body)))
                   for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r[0] for r in results)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        assert all(r[2].get("retry-after") == "1" or r[2].get("Retry-After") == "1" for r in results if r[0] == 429)

        real = engine._finish_reason  # a fault inside the engine, for one request's second token
        monkeypatch.setattr(engine, "_finish_reason",
                            lambda req, tok: 1 / 0 if req.prompt == [5, 6, 7] and len(req.output) == 2 else real(req, tok))
        bad = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).encode()
        good = json.dumps({"prompt": [5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
        status, text, _ = _raw(url, "/v1/completions", bad)
        assert status == 500 and "ZeroDivisionError" in json.loads(text)["error"]["message"]
        assert _raw(url, "/v1/completions", good)[0] == 200
        assert engine.allocator.free == engine.allocator.total
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.smoke  # the benchmark end to end in subprocesses: make test-slow
def test_bench_serving_quick_smoke(tmp_path):
    """bench_serving --quick: the five arms on 8 requests to a tiny model, tokens identical across arms."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "serving.json"
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "scripts.benchmarks.bench_serving", "--quick", "--out", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["hf-one", "hf-batch", "engine", "serve", "serve-openai"]
    for r in rows:
        assert "error" not in r, r
        assert r["output_tok_per_s"] > 0 and r["identical"] == "8/8", r
