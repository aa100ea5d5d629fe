"""Chat prompts token for token against transformers' ``apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)`` (the reference, computed by transformers on the same saved directory),
on a Llama-2-style template (``{{ bos_token }}`` in the text, and a tokenizer whose post-processor
also adds BOS: the double-BOS trap) and on a ChatML template."""
from __future__ import annotations

import json

import pytest

from conftest import require_module

require_module("jinja2", allow_module_level=True)
require_module("transformers", allow_module_level=True)

LLAMA = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHATS = [
    [{"role": "user", "content": "the cat sat"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "to be or not"},
     {"role": "assistant", "content": "that is the question"}, {"role": "user", "content": "the dog?"}],
    [{"role": "user", "content": "a cat and a dog met on the mat, caf\u00e9 \u2603"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE trained here whose post-processor prepends <s> (as Llama's does), saved
    through transformers with bos <s> (id 1), eos </s> (id 2)."""
    from tokenizers import processors

    from parity_tests.hf_dirs import bpe_tokenizer, save_tokenizer

    path = tmp_path_factory.mktemp("chat")
    tok = bpe_tokenizer(specials=SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    save_tokenizer(tok, path, bos_token="<s>", eos_token="</s>")
    (path / "config.json").write_text(json.dumps({"vocab_size": 320, "bos_token_id": 1, "eos_token_id": 2}))
    return path


def _theirs(path, template, messages):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _ours(path, template, messages):
    from jaxgpt.data.hf_tokenizer import HFTokenizer
    from jaxgpt.inference.chat_template import chat_prompt_ids

    # through to_dict / from_dict, as `jaxgpt serve` loads it
    return chat_prompt_ids(template, messages, HFTokenizer.from_dict(HFTokenizer.from_dir(path).to_dict()))


@pytest.mark.parametrize("template", [LLAMA, CHATML], ids=["llama", "chatml"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_prompt_ids_equal_transformers(tok_dir, template, chat):
    messages = CHATS[chat]
    want = _theirs(tok_dir, template, messages)
    assert _ours(tok_dir, template, messages) == want
    if template is LLAMA:  # the trap this guards: one BOS, from the template, not a second from encode
        assert want[0] == 1 and want[1] != 1


def test_text_parts_are_joined_and_other_parts_refused(tok_dir):
    from jaxgpt.inference.protocol import ApiError

    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]}]
    assert _ours(tok_dir, CHATML, parts) == _theirs(tok_dir, CHATML, [{"role": "user", "content": "the cat\nsat"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ApiError, match=r"content\[0\].*text only") as e:
        _ours(tok_dir, CHATML, image)
    assert e.value.status == 400 and e.value.param == "messages"


@pytest.mark.parametrize("messages, match", [
    ([{"role": "assistant", "content": "hi"}], "Conversation roles must alternate"),  # raise_exception
    ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "user"}], r"messages\[0\]\.content is required"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], r"messages\[0\]\.tool_calls is not supported"),
    ([], "non-empty list"),
])
def test_bad_messages_and_template_errors_are_400(tok_dir, messages, match):
    from jaxgpt.inference.protocol import ApiError

    with pytest.raises(ApiError, match=match) as e:
        _ours(tok_dir, LLAMA, messages)
    assert e.value.status == 400 and e.value.param == "messages"


def test_a_broken_template_is_400_not_a_crash(tok_dir):
    from jaxgpt.inference.protocol import ApiError

    with pytest.raises(ApiError, match="TemplateSyntaxError") as e:
        _ours(tok_dir, "{% for m in messages %}{{ m.content }", CHATS[0])
    assert e.value.status == 400 and e.value.code == "chat_template_error"


def test_special_tokens_come_from_tokenizer_config(tok_dir):
    from jaxgpt.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(tok_dir)
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert list(tok.encode("the cat"))[0] == 1 and list(tok.encode("the cat", add_special_tokens=False))[0] != 1


def test_token_bytes_rebuild_the_text_and_partial_characters_are_written_as_bytes(tok_dir):
    """Reference: the text encoded; byte-level tokens that split a character get OpenAI's 'bytes:' form."""
    from jaxgpt.data.hf_tokenizer import HFTokenizer
    from jaxgpt.inference.responses import token_text

    tok = HFTokenizer.from_dir(tok_dir)
    text = "caf\u00e9 \u2603 the cat"
    ids = list(tok.encode(text, add_special_tokens=False))
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    names = [token_text(tok, i) for i in ids]
    assert "bytes:\\xe2" in names and names[-1] == " cat" and token_text(tok, 1) == "<s>"
