"""``protocol.parse_completion`` / ``parse_chat`` without a server: OpenAI's defaults, each field
reaching the engine's SamplingParams, and each refusal a 400 naming its field (the expected values
are OpenAI's API reference, written out here)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from jaxgpt.data.tokenizers import CharTokenizer
from jaxgpt.inference.protocol import ApiError, parse_chat, parse_completion
from jaxgpt.inference.sampling import SamplingParams

ENGINE = SimpleNamespace(config=SimpleNamespace(vocab_size=100, token_vocab=100, max_len=64), max_model_len=64)
CHAR = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz <>\n"))
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
NEW_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} >= {
    "presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs"}


def comp(**body):
    return parse_completion({"prompt": [5, 6], **body}, ENGINE, CHAR)


def chat(**body):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, ENGINE, CHAR, TEMPLATE)


def refused(fn, param, match, **body):
    with pytest.raises(ApiError, match=match) as e:
        fn(**body)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)


def test_defaults_follow_openai():
    p = comp()
    assert p.params[0].max_tokens == 16 and p.params[0].temperature == 1.0 and p.params[0].top_p == 1.0
    assert p.n == 1 and p.logprobs is None and not p.echo and not p.stream and p.stop == ()
    c = chat()
    assert c.params[0].max_tokens == 64 - len(c.prompts[0])  # chat: the rest of the context
    assert c.prompts[0] == list(CHAR.encode("<user>hi\n<assistant>"))


def test_prompt_forms_and_choice_order():
    assert comp().prompts == [[5, 6]]
    assert parse_completion({"prompt": "ab"}, ENGINE, CHAR).prompts == [[0, 1]]
    p = parse_completion({"prompt": ["ab", "c"], "n": 2, "seed": 7}, ENGINE, CHAR)
    assert p.prompts == [[0, 1], [2]] and len(p.params) == 4  # choice c answers prompt c // n
    assert [s.seed for s in p.params] == [7, 8, 9, 10]
    assert parse_completion({"prompt": [[1], [2, 3]]}, ENGINE, CHAR).prompts == [[1], [2, 3]]
    for bad in ([], [[]], ["a", [1]], [1.5], {"a": 1}, [True]):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": bad}, ENGINE, CHAR)
        assert e.value.status == 400 and e.value.param == "prompt", bad


def test_seed_absent_draws_fresh_entropy_and_given_repeats():
    """An unseeded choice leaves the seed to the engine, which draws fresh entropy (test_engine_sampling);
    a given seed reaches it, seed + c for choice c."""
    assert [s.seed for s in comp(temperature=1, n=2).params] == [None, None]
    assert comp(seed=3).params[0].seed == comp(seed=3).params[0].seed == 3
    assert [s.seed for s in comp(seed=3, n=3).params] == [3, 4, 5]


def test_fields_reach_sampling_params():
    p = comp(temperature=0.5, top_p=0.9, top_k=4, stop=["x", "y"], stop_token_ids=[3], ignore_eos=True,
             max_tokens=5, logprobs=0, user="u1", stream=True, stream_options={"include_usage": True},
             return_token_ids=True, best_of=1)
    s = p.params[0]
    assert (s.temperature, s.top_p, s.top_k, s.stop_token_ids, s.ignore_eos, s.max_tokens, s.logprobs) == (
        0.5, 0.9, 4, (3,), True, 5, True)
    assert s.stop == () and p.stop == ("x", "y")  # stop strings: the server's detokenizer decides them
    assert comp(echo=True).echo and p.user == "u1" and p.stream and p.include_usage and p.return_token_ids and p.logprobs == 0
    c = chat(max_completion_tokens=7, logprobs=True, response_format={"type": "text"}, tools=[], tool_choice="none",
             store=False, parallel_tool_calls=None)
    assert c.params[0].max_tokens == 7 and c.logprobs == 0 and c.params[0].logprobs


@pytest.mark.parametrize("fn, param, match, body", [
    (comp, "frobnicate", "Unrecognized request argument supplied: frobnicate", {"frobnicate": 1}),
    (chat, "max_tokenz", "Unrecognized request argument supplied: max_tokenz", {"max_tokenz": 1}),
    (comp, "max_completion_tokens", "Unrecognized", {"max_completion_tokens": 3}),  # a chat field
    (comp, "suffix", "suffix", {"suffix": "end"}),
    (chat, "tools", "no tool calling", {"tools": [{"type": "function"}]}),
    (chat, "tool_choice", "tool_choice", {"tool_choice": "required"}),
    (chat, "store", "store", {"store": True}),
    (comp, "suffix", "suffix", {"suffix": "none"}),
    (comp, "suffix", "suffix", {"suffix": 0}),
    (chat, "response_format", "JSON mode", {"response_format": {"type": "json_object"}}),
    (comp, "best_of", "best_of=3 must equal n=1", {"best_of": 3}),
    (comp, "n", "at most 128", {"n": 129}),
    (comp, "n", ">= 1", {"n": 0}),
    (comp, "echo", "echo with logprobs", {"echo": True, "logprobs": 1}),
    (comp, "logprobs", "<= 5", {"logprobs": 6}),
    (comp, "logprobs", "an integer", {"logprobs": True}),
    (chat, "logprobs", "true or false", {"logprobs": 1}),
    (chat, "top_logprobs", "needs logprobs: true", {"top_logprobs": 2}),
    (chat, "top_logprobs", "<= 20", {"logprobs": True, "top_logprobs": 21}),
    (comp, "stop", "at most 4", {"stop": ["a", "b", "c", "d", "e"]}),
    (comp, "stop", "non-empty string", {"stop": [""]}),
    (comp, "stop", "non-empty string", {"stop": [1]}),
    (comp, "stop_token_ids", r"\[0, 100\)", {"stop_token_ids": [100]}),
    (comp, "stream_options", "only allowed when stream is true", {"stream_options": {"include_usage": True}}),
    (comp, "stream_options", "include_usage only", {"stream": True, "stream_options": {"x": 1}}),
    (comp, "temperature", "<= 2.0", {"temperature": 2.5}),
    (comp, "top_p", "> 0.0", {"top_p": 0}),
    (comp, "presence_penalty", ">= -2.0", {"presence_penalty": -3}),
    (comp, "frequency_penalty", "<= 2.0", {"frequency_penalty": 2.5}),
    (comp, "logit_bias", "not a token id", {"logit_bias": {"abc": 1}}),
    (comp, "logit_bias", "not a token id", {"logit_bias": {"100": 1}}),
    (comp, "logit_bias", "<= 100.0", {"logit_bias": {"5": 101}}),
    (comp, "seed", "an integer", {"seed": "x"}),
    (comp, "user", "a string", {"user": 5}),
    (comp, "max_tokens", "lower max_tokens to at most 62", {"max_tokens": 63}),
    (chat, "max_completion_tokens", "not both", {"max_tokens": 3, "max_completion_tokens": 4}),
    (comp, "stream", "true or false", {"stream": "yes"}),
])
def test_refusals_name_their_field(fn, param, match, body):
    refused(fn, param, match, **body)


def test_a_bad_character_is_400():
    with pytest.raises(ApiError, match="'Z' at position 1") as e:
        parse_completion({"prompt": "aZ"}, ENGINE, CHAR)
    assert e.value.status == 400 and e.value.param == "prompt"
    with pytest.raises(ApiError, match="'Z'") as e:
        parse_chat({"messages": [{"role": "user", "content": "Z"}]}, ENGINE, CHAR, TEMPLATE)
    assert e.value.status == 400 and e.value.param == "messages"


def test_prompt_longer_than_the_context_is_400():
    with pytest.raises(ApiError, match="context is 64") as e:
        parse_completion({"prompt": [1] * 64}, ENGINE, CHAR)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("field, value, param, attr, want", [
    ("presence_penalty", 0.5, "presence_penalty", "presence_penalty", 0.5),
    ("frequency_penalty", -1.0, "frequency_penalty", "frequency_penalty", -1.0),
    ("logit_bias", {"7": 5, "3": -100}, "logit_bias", "logit_bias", ((3, -100.0), (7, 5.0))),
    ("logprobs", 3, "logprobs", "top_logprobs", 3),
])
def test_new_sampling_fields_are_honoured_or_refused_by_name(field, value, param, attr, want):
    """With the sampler's fields (SamplingParams.presence_penalty, ...) each value reaches the engine;
    an engine without them refuses the field by name instead of dropping it."""
    if NEW_FIELDS:
        assert getattr(comp(**{field: value}).params[0], attr) == want
    else:
        refused(comp, param, "not supported by this engine", **{field: value})


def test_logprob_formats_of_both_endpoints():
    """responses' two formats on a hand-made update (the top pairs as the sampler returns them)."""
    from jaxgpt.inference.responses import Update, chat_logprobs, completion_logprobs

    u = Update(ids=[0, 1], logprobs=[-0.5, float("-inf")], tops=[[(0, -0.5), (2, -1.0)], [(2, -0.1), (3, -2.0)]],
               text="ab")
    c = completion_logprobs(CHAR, u, 1, offset=3)
    assert c == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -9999.0], "text_offset": [3, 4],
                 "top_logprobs": [{"a": -0.5}, {"c": -0.1, "b": -9999.0}]}  # the sampled token always in
    ch = chat_logprobs(CHAR, u, 2)
    assert ch["refusal"] is None and [t["token"] for t in ch["content"]] == ["a", "b"]
    assert ch["content"][1]["top_logprobs"] == [{"token": "c", "logprob": -0.1, "bytes": [99]},
                                                {"token": "d", "logprob": -2.0, "bytes": [100]}]
    assert ch["content"][0]["bytes"] == [97] and ch["content"][1]["logprob"] == -9999.0


def test_text_fields_without_a_tokenizer_are_refused():
    for body, param in (({"stop": "x"}, "stop"), ({"echo": True}, "echo"), ({"prompt": "ab"}, "prompt")):
        with pytest.raises(ApiError, match="tokenizer") as e:
            parse_completion({"prompt": [1, 2], **body}, ENGINE, None)
        assert e.value.status == 400 and e.value.param == param
    assert parse_completion({"prompt": [1, 2], "stop_token_ids": [3]}, ENGINE, None).params[0].stop_token_ids == (3,)
