"""Every field of ``jaxgpt serve``'s OpenAI API through a real uvicorn server: each response,
streamed and not, validated by the ``openai`` package's own pydantic types (``model_validate``,
strict on literals such as finish_reason, not the client's lenient ``construct``), each refusal a 400
naming its field. References the test did not compute: transformers' logits for greedy tokens and
log-probabilities; OpenAI's API reference for formats and defaults.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from conftest import require_module

pytestmark = pytest.mark.e2e  # real uvicorn servers: make test-slow

openai = require_module("openai", allow_module_level=True)
require_module("fastapi", allow_module_level=True)
require_module("uvicorn", allow_module_level=True)

try:  # the openai client's own HTTP package: httpx2 in the versions that renamed it
    import httpx2 as httpx
except ImportError:
    import httpx
from openai.types import Completion, Model  # noqa: E402  (after the dependency check)
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from test_serve import CTX, _serve, model_dir  # noqa: E402, F401  (model_dir: the shared fixture)

from jaxgpt.data.hf_tokenizer import HFTokenizer  # noqa: E402
from jaxgpt.inference.responses import token_text  # noqa: E402

NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    server, thread, engine, url = _serve(model_dir[0])
    yield url, engine, model_dir[1], model_dir[0]
    server.should_exit = True
    thread.join(timeout=10)


def post(url, path, body, stream=False, done=True):
    """(status, JSON body or the list of SSE data objects) with httpx: the raw bytes, nothing parsed for us.
    done: the stream must end with [DONE] (a failed one ends with its error event instead)."""
    with httpx.Client(timeout=60) as c:
        r = c.post(url + path, json=body)
        if not stream or r.status_code != 200:
            return r.status_code, r.json()
        lines = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
        assert (lines[-1] == "[DONE]") == done, lines[-3:]
        return r.status_code, [json.loads(x) for x in lines[:-1 if done else None]]


def completion(url, **body):
    status, out = post(url, "/v1/completions", {"model": NAME, **body}, stream=body.get("stream", False))
    assert status == 200, out
    if body.get("stream"):
        return [_completion_chunk(c) for c in out]
    return Completion.model_validate(out)


def _completion_chunk(c: dict) -> Completion:
    """A streamed completion chunk: the type is Completion, whose finish_reason is required, but
    OpenAI's own streams send null until the last chunk (the client parses them leniently); every
    other field is validated strictly."""
    Completion.model_validate(dict(c, choices=[dict(x, finish_reason=x["finish_reason"] or "length")
                                               for x in c["choices"]]))
    return openai._models.construct_type(type_=Completion, value=c)  # as the client builds it


def chat(url, **body):
    body = {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], **body}
    status, out = post(url, "/v1/chat/completions", body, stream=body.get("stream", False))
    assert status == 200, out
    if body.get("stream"):
        return [ChatCompletionChunk.model_validate(c) for c in out]
    return ChatCompletion.model_validate(out)


def pages_free(engine):
    for _ in range(100):
        if engine.allocator.free == engine.allocator.total and not engine.has_unfinished():
            return True
        time.sleep(0.05)
    return False


def _bytes_of(token: str) -> bytes:
    """A completions token's bytes: OpenAI writes 'bytes:\\xe2\\x80' for part of a UTF-8 character."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode("utf-8")


def hf_logprobs(model, prompt, out):
    """transformers' log-softmax of each generated token and the greedy argmax at each position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits.double(), -1)
    return lp.gather(1, torch.tensor(out)[:, None])[:, 0].numpy(), lp.argmax(-1).tolist(), lp


def test_models_list_and_retrieve(server):
    url, _, _, _ = server
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in c.models.list().data] == [NAME]
    m = Model.model_validate(httpx.get(url + "/v1/models/" + NAME).json())
    assert m.id == NAME and m.model_extra["max_model_len"] == CTX
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


def test_completion_defaults_greedy_logprobs_match_transformers(server):
    """max_tokens defaults to 16 (OpenAI), logprobs=0 gives the sampled token's log-probability,
    equal to transformers' log-softmax to 1e-4 (float32 engine against float64 of torch's logits)."""
    url, _, model, _ = server
    r = completion(url, prompt=[5, 6, 7], temperature=0, logprobs=0, ignore_eos=True, return_token_ids=True)
    ch = r.choices[0]
    ids = ch.model_extra["token_ids"]
    assert r.usage.completion_tokens == len(ids) == 16 and ch.finish_reason == "length"
    lp, greedy, _ = hf_logprobs(model, [5, 6, 7], ids)
    assert ids == greedy
    np.testing.assert_allclose(ch.logprobs.token_logprobs, lp, atol=1e-4)
    assert [list(d) for d in ch.logprobs.top_logprobs] == [[t] for t in ch.logprobs.tokens]  # the sampled one
    text = b"".join(_bytes_of(t) for t in ch.logprobs.tokens).decode("utf-8", "replace")
    assert text.replace("<|endoftext|>", "") == ch.text  # the text skips special tokens
    assert ch.logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in ch.logprobs.tokens[:-1]]))
    chunks = completion(url, prompt=[5, 6, 7], temperature=0, logprobs=0, ignore_eos=True, stream=True)
    got = [c.logprobs for x in chunks for c in x.choices if c.logprobs]
    assert sum((g.tokens for g in got), []) == ch.logprobs.tokens
    assert sum((g.text_offset for g in got), []) == ch.logprobs.text_offset  # offsets run on across chunks
    np.testing.assert_allclose(sum((g.token_logprobs for g in got), []), lp, atol=1e-4)


def test_n_prompt_lists_seeds_and_streams_agree(server):
    """Choices prompt-major (index = prompt * n + j); a seed repeats, choices of one request differ,
    and the streamed request gives the same texts as the plain one."""
    url, engine, _, _ = server
    body = dict(prompt=["the cat", "a dog"], n=2, seed=11, temperature=1, max_tokens=8, ignore_eos=True,
                return_token_ids=True)
    a, b = completion(url, **body), completion(url, **body)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    ids = [c.model_extra["token_ids"] for c in a.choices]
    assert ids == [c.model_extra["token_ids"] for c in b.choices]
    assert ids[0] != ids[1] and ids[2] != ids[3]
    tok = HFTokenizer.from_dir(server[3])
    p0, p1 = (list(map(int, tok.encode(t))) for t in ("the cat", "a dog"))
    assert [c.model_extra["prompt_token_ids"] for c in a.choices] == [p0, p0, p1, p1]  # prompt-major
    assert a.usage.completion_tokens == 32 and a.usage.prompt_tokens == len(p0) + len(p1)
    chunks = completion(url, stream=True, **body)
    streamed = {i: "" for i in range(4)}
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in a.choices]
    assert pages_free(engine)


def test_unseeded_requests_differ_and_seeded_repeat(server):
    url, _, _, _ = server
    body = dict(prompt="the cat", temperature=1, max_tokens=16, ignore_eos=True, return_token_ids=True)
    ids = lambda r: r.choices[0].model_extra["token_ids"]
    assert ids(completion(url, **body)) != ids(completion(url, **body))
    assert ids(completion(url, seed=5, **body)) == ids(completion(url, seed=5, **body))


def test_echo_plain_and_streamed(server):
    url, _, _, _ = server
    r = completion(url, prompt="the cat", echo=True, max_tokens=4, temperature=0, ignore_eos=True)
    assert r.choices[0].text.startswith("the cat") and len(r.choices[0].text) > len("the cat")
    streamed = "".join(c.text for ch in completion(url, prompt="the cat", echo=True, max_tokens=4, temperature=0,
                                                   ignore_eos=True, stream=True) for c in ch.choices)
    assert streamed == r.choices[0].text


def test_stop_strings_and_ids_plain_and_streamed(server):
    """A stop string cut from the text (finish 'stop'), decided by the server, the engine's request
    aborted: every page free afterwards; a stop id ends the choice at that token."""
    url, engine, _, _ = server
    base = dict(prompt="to be or", max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True)
    full = completion(url, **base).choices[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    want = text[:text.find(stop)]
    before = engine.stats["generated_tokens"]
    r = completion(url, stop=[stop, "\u2603"], **base).choices[0]
    assert (r.text, r.finish_reason) == (want, "stop")
    assert pages_free(engine) and engine.stats["generated_tokens"] - before < 24  # aborted, not run to max_tokens
    chunks = completion(url, stop=stop, stream=True, **base)
    assert "".join(c.text for ch in chunks for c in ch.choices) == want
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "stop"
    third = full.model_extra["token_ids"][2]
    first = full.model_extra["token_ids"].index(third)
    r = completion(url, stop_token_ids=[third], **base).choices[0]
    assert r.model_extra["token_ids"] == full.model_extra["token_ids"][:first + 1] and r.finish_reason == "stop"
    assert pages_free(engine)


def test_stream_usage_and_openai_client_streams(server):
    url, _, _, _ = server
    chunks = completion(url, prompt=[5, 6], max_tokens=5, temperature=0, ignore_eos=True, stream=True,
                        stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              temperature=0, stream=True, stream_options={"include_usage": True},
                                              logprobs=True, extra_body={"ignore_eos": True}))
    assert got[0].choices[0].delta.role == "assistant" and got[-1].usage.completion_tokens == 3
    assert sum(len(c.choices[0].logprobs.content) for c in got if c.choices and c.choices[0].logprobs) == 3


def test_chat_defaults_text_parts_logprobs_and_limits(server):
    """Chat: max_tokens defaults to the rest of the context; text parts; logprobs in chat's format
    (token, logprob, bytes, top_logprobs) equal transformers' log-softmax, plain and streamed."""
    url, _, model, _ = server
    parts = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]}]
    r = chat(url, messages=parts, temperature=0, ignore_eos=True, logprobs=True, return_token_ids=True, user="me")
    ch = r.choices[0]
    prompt = ch.model_extra["prompt_token_ids"]
    assert r.usage.completion_tokens == CTX - len(prompt) == len(ch.logprobs.content) and ch.finish_reason == "length"
    ids = ch.model_extra["token_ids"]
    lp, greedy, _ = hf_logprobs(model, prompt, ids)
    assert ids == greedy
    np.testing.assert_allclose([t.logprob for t in ch.logprobs.content], lp, atol=1e-4)
    assert all(t.top_logprobs == [] and _bytes_of(t.token) == bytes(t.bytes) for t in ch.logprobs.content)
    assert b"".join(bytes(t.bytes) for t in ch.logprobs.content).decode("utf-8", "replace").replace(
        "<|endoftext|>", "") == ch.message.content
    r2 = chat(url, messages=parts, temperature=0, ignore_eos=True, max_completion_tokens=4, logprobs=True, stream=True)
    streamed = [t.logprob for c in r2 for x in c.choices if x.logprobs for t in x.logprobs.content]
    np.testing.assert_allclose(streamed, lp[:4], atol=1e-4)
    assert "".join(x.delta.content or "" for c in r2 for x in c.choices) == b"".join(
        bytes(t.bytes) for t in ch.logprobs.content[:4]).decode("utf-8", "replace").replace("<|endoftext|>", "")
    r3 = chat(url, messages=parts, temperature=0, max_tokens=3, n=2, response_format={"type": "text"},
              ignore_eos=True)
    assert [c.index for c in r3.choices] == [0, 1] and r3.usage.completion_tokens == 6


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": CTX}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_refusals_are_400_with_openai_bodies(server, path, body, param):
    status, out = post(server[0], path, {"model": NAME, **body})
    assert status == 400 and set(out["error"]) == {"message", "type", "param", "code"}, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request_naming_the_field(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: foo"):
        client.completions.create(model=NAME, prompt="a", extra_body={"foo": 1})


def test_unknown_routes_and_injected_faults_are_openai_errors(server, monkeypatch):
    """A 404 route, a 405 method and an exception injected into the handler path: JSON error bodies,
    no traceback, and the server answers afterwards."""
    url, engine, _, _ = server
    r = httpx.post(url + "/v1/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("Not Found")
    assert httpx.get(url + "/v1/completions").status_code == 405
    import jaxgpt.inference.server as srv

    def boom(*a, **k):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(srv.Run, "submit", boom)
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": stream})
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert "RuntimeError" in err["message"] and "Traceback" not in r.text and err["type"] == "server_error"
    monkeypatch.undo()
    monkeypatch.setattr(srv.ChoiceState, "add", boom)  # a fault once the stream's headers are sent
    status, events = post(url, "/v1/completions", {"prompt": [5], "max_tokens": 20, "stream": True,
                                                   "ignore_eos": True}, stream=True, done=False)
    assert status == 200 and "RuntimeError" in events[-1]["error"]["message"], events
    with pytest.raises(openai.APIError, match="internal server error"):
        list(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
            model=NAME, prompt=[5], max_tokens=20, stream=True))
    r = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json" and "Traceback" not in r.text
    monkeypatch.undo()
    assert completion(url, prompt=[5], max_tokens=2).usage.completion_tokens >= 1
    assert pages_free(engine)


# -- needs the sampler's SamplingParams fields ---------------------------------------------------------

def _penalised_greedy(model, prompt, n, presence, frequency, bias):
    """OpenAI's documented rule on transformers' logits: mu[j] - c[j] * frequency - (c[j] > 0) * presence
    + logit_bias[j], c counting the tokens generated so far; greedy."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
        logits = logits - counts * frequency - (counts > 0).double() * presence
        for j, b in bias.items():
            logits[j] += b
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_logit_bias_follow_openai_rule(server):
    url, _, model, _ = server
    bias = {7: 3.0, 9: -100.0}
    r = completion(url, prompt=[5, 6], max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True,
                   presence_penalty=0.7, frequency_penalty=1.3, logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].model_extra["token_ids"] == _penalised_greedy(model, [5, 6], 12, 0.7, 1.3, bias)
    r = completion(url, prompt=[5, 6], max_tokens=4, temperature=1, ignore_eos=True, return_token_ids=True,
                   logit_bias={"42": 100})
    assert r.choices[0].model_extra["token_ids"] == [42] * 4


def test_top_logprobs_in_both_formats_match_transformers(server):
    url, _, model, _ = server
    r = completion(url, prompt=[5, 6], max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, return_token_ids=True)
    ch = r.choices[0]
    tok = HFTokenizer.from_dir(server[3])
    ids = ch.model_extra["token_ids"]
    _, _, lp = hf_logprobs(model, [5, 6], ids)
    for d, row, i in zip(ch.logprobs.top_logprobs, lp, ids):
        top = torch.topk(row, 3)  # the reference's top 3, written as the format says (texts as keys)
        want = {token_text(tok, int(j)): float(x) for x, j in zip(top.values, top.indices)}
        want.setdefault(token_text(tok, i), float(row[i]))
        assert list(d) == list(want)
        np.testing.assert_allclose(list(d.values()), list(want.values()), atol=1e-4)
    c = chat(url, max_tokens=3, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2).choices[0]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in c.logprobs.content)
    chunks = chat(url, max_tokens=3, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2, stream=True)
    assert sum(len(t.top_logprobs) for ch in chunks for x in ch.choices if x.logprobs for t in x.logprobs.content) == 6
