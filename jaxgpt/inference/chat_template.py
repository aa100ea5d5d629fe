"""Chat messages -> prompt ids the way transformers' ``apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)`` makes them: the template rendered once in jinja2's sandbox with
transformers' globals (``raise_exception``, ``strftime_now``, its ``tojson``) and the tokenizer's
special-token strings, then encoded WITHOUT the tokenizer's post-processor, since the rendered
text already holds the template's ``{{ bos_token }}`` (encoding with it gave Llama-style
templates a double BOS).

Messages are checked first (roles, string or text-part content); a template that fails
(``raise_exception``, a syntax error, an undefined name) is the client's 400, naming ``messages``.
"""
from __future__ import annotations

import inspect
import json
from datetime import datetime
from functools import lru_cache

from jaxgpt.inference.errors import ApiError

ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "name"}


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined by
    newlines, as vLLM does); other part types (images, audio, files) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                       param="messages")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ApiError(400, f"{where}.content[{k}] must be {{'type': 'text', 'text': str}}; this server takes text "
                                f"only, got {json.dumps(part)[:80]}", param="messages")
        parts.append(part["text"])
    return "\n".join(parts)


def check_messages(messages) -> list[dict]:
    """The request's messages with text content, or a 400 naming the first bad one."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object, got {type(m).__name__}", param="messages")
        extra = sorted(set(m) - MESSAGE_KEYS)
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported (this server takes role, content and name; "
                                "no tools)", param="messages")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                           param="messages")
        if "content" not in m:
            raise ApiError(400, f"{where}.content is required", param="messages")
        if "name" in m and not isinstance(m["name"], str):
            raise ApiError(400, f"{where}.name must be a string", param="messages")
        out.append({**m, "content": _text(m["content"], where)})
    return out


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja2's own escapes HTML characters, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def special_tokens(tokenizer) -> dict[str, str]:
    """bos_token / eos_token / ... strings for the template: the tokenizer's own map (HFTokenizer),
    else the text of its bos/eos ids."""
    own = getattr(tokenizer, "special_tokens", None)
    if isinstance(own, dict):
        return dict(own)
    out = {}
    for key in ("bos_token", "eos_token"):
        i = getattr(tokenizer, key.replace("token", "id"), None)
        if i is not None:
            out[key] = tokenizer.decode([i])
    return out


def render_chat(template: str, messages, tokenizer) -> str:
    """The template's text for ``messages`` (checked) with the generation prompt."""
    import jinja2

    messages = check_messages(messages)
    try:
        return _compile(template).render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                         **special_tokens(tokenizer))
    except jinja2.TemplateError as e:
        raise ApiError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages", code="chat_template_error") from None


def chat_prompt_ids(template: str, messages, tokenizer) -> list[int]:
    """Rendered once, encoded without the post-processor's special tokens (transformers' way)."""
    text = render_chat(template, messages, tokenizer)
    # jaxgpt's own tokenizers (char, BPE) add no special tokens and take no such argument
    kw = {"add_special_tokens": False} if "add_special_tokens" in inspect.signature(tokenizer.encode).parameters else {}
    try:
        ids = tokenizer.encode(text, **kw)
    except ValueError as e:  # a character outside a character vocabulary
        raise ApiError(400, f"the rendered chat cannot be tokenized: {e}", param="messages") from None
    return [int(i) for i in ids]
