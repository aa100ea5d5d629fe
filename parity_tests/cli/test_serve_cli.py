"""``jaxgpt serve`` as a process (jaxgpt/cli/serve.py): the operations flags on a tiny HF LLaMA
directory built here, and a graceful shutdown: SIGTERM while a stream is open ends the stream
(finished, or cut once --shutdown-timeout passes) and the process exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import require_module

pytestmark = pytest.mark.e2e  # a subprocess server: make test-slow

openai = require_module("openai", allow_module_level=True)
require_module("uvicorn", allow_module_level=True)
from parity_tests.engine.test_serve import _free_port, model_dir  # noqa: E402, F401  (model_dir: the shared tiny HF LLaMA directory)

KEY = "sk-cli-test"


def test_sigterm_ends_the_stream_and_exits_0(model_dir, tmp_path):  # noqa: F811 - the shared fixture
    port, log = _free_port(), tmp_path / "access.jsonl"
    env = dict(os.environ, JAXGPT_API_KEY=KEY)
    cmd = [sys.executable, "-m", "jaxgpt", "serve", str(model_dir[0]), "--port", str(port), "--max-seqs", "2",
           "--no-precompile", "--kv-cache-memory", "1MiB", "--max-model-len", "48", "--request-timeout", "60",
           "--access-log", str(log), "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.models.list().data[0].max_model_len in (48, 64)  # the server helper may report either
        stream = client.completions.create(model="tiny-llama", prompt="the cat", max_tokens=40, temperature=0,
                                           stream=True)
        chunks, finish = 0, None
        try:
            for chunk in stream:
                chunks += 1
                if chunks == 1:
                    proc.send_signal(signal.SIGTERM)
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
        except openai.APIConnectionError:
            finish = "cut"  # --shutdown-timeout passed: the server cancelled it and closed the connection
        assert chunks >= 1 and finish in ("length", "stop", "cut"), finish
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "shut down" in err, err
        assert "max_model_len 48" in err and "KV pages" in err
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {"/health", "/v1/models", "/v1/completions"} <= {r["path"] for r in records}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
