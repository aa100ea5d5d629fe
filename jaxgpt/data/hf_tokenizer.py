"""The tokenizer of a Hugging Face model directory (``tokenizer.json``), through the ``tokenizers``
package: no transformers, no downloads.

Special token ids come from the directory's ``config.json``, overridden by ``generation_config.json``
where it sets them (as transformers' ``generate`` does). ``encode`` applies the tokenizer's own
post-processor, so a LLaMA tokenizer adds its BOS exactly as ``AutoTokenizer`` does;
``encode(text, add_special_tokens=False)`` does not (a rendered chat template already holds them).
The special tokens' strings (``special_tokens``: bos_token, eos_token, ...) come from
``tokenizer_config.json``, as transformers' ``special_tokens_map``, which chat templates read.

``to_dict`` also carries, verbatim, the directory's other tokenizer-side files (``CARRIED``:
tokenizer_config.json, special_tokens_map.json, the chat template, generation_config.json) and
config.json's own special ids: the one record that checkpoints, weight files and fine-tuning runs
keep, from which ``jaxgpt.convert.hf_files`` writes an HF directory back unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

_SPECIALS = ("bos_token_id", "eos_token_id", "pad_token_id")
_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What transformers reads back besides tokenizer.json and config.json (chat templates: transformers 5
# writes chat_template.jinja and named ones under additional_chat_templates/; older ones keep it in
# tokenizer_config.json).
CARRIED = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
           "generation_config.json", "additional_chat_templates/*.jinja")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None


def special_ids(directory: str | Path) -> dict[str, list[int]]:
    """{'bos_token_id' | 'eos_token_id' | 'pad_token_id': ids} from config.json, then
    generation_config.json (which wins). A single id becomes a one-element list; unset names are absent."""
    d = Path(directory)
    out: dict[str, list[int]] = {}
    for name in ("config.json", "generation_config.json"):
        cfg = _read_json(d / name)
        for key in _SPECIALS:
            value = cfg.get(key)
            if value is not None:
                out[key] = [int(v) for v in (value if isinstance(value, list) else [value])]
    return out


def config_ids(directory: str | Path) -> dict[str, int | list[int]]:
    """config.json's own bos/eos/pad ids, as written there (generation_config.json may differ)."""
    cfg = _read_json(Path(directory) / "config.json")
    return {k: cfg[k] for k in _SPECIALS if cfg.get(k) is not None}


def carried_files(directory: str | Path) -> dict[str, str]:
    """{path relative to ``directory``: text} of the ``CARRIED`` files it has."""
    d = Path(directory)
    return {p.relative_to(d).as_posix(): p.read_text(encoding="utf-8")
            for pattern in CARRIED for p in sorted(d.glob(pattern)) if p.is_file()}


def chat_template_in(files: dict[str, str]) -> str | None:
    """The default chat template of carried files: chat_template.jinja, else tokenizer_config.json's."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"]
    for name in ("chat_template.json", "tokenizer_config.json"):
        t = json.loads(files[name]).get("chat_template") if name in files else None
        if isinstance(t, str):
            return t
    return None


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (``bytes_to_unicode`` inverted)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


def special_tokens(directory: str | Path) -> dict[str, str]:
    """{'bos_token': '<s>', ...} from tokenizer_config.json (a string or an AddedToken dict each)."""
    cfg = _read_json(Path(directory) / "tokenizer_config.json")
    out = {}
    for key in _TOKEN_NAMES:
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


class HFTokenizer:
    """``tokenizer.json`` of an HF directory with its special ids. ``vocab_size`` is the model's
    (``config.json``), which may exceed the tokenizer's own count (padded embedding tables)."""

    kind = "hf"

    def __init__(self, tokenizer_json: str, *, vocab_size: int | None = None,
                 specials: dict[str, list[int]] | None = None, tokens: dict[str, str] | None = None,
                 files: dict[str, str] | None = None, config_ids: dict | None = None):
        """``files``: the directory's ``CARRIED`` files (path -> text); ``config_ids``: config.json's
        bos/eos/pad ids as written there (None: unknown, exports derive them from ``specials``)."""
        from tokenizers import Tokenizer  # optional dependency, needed for HF directories only

        self._json = tokenizer_json  # kept verbatim: an export writes back the same file
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.files = dict(files or {})
        self.config_ids = None if config_ids is None else dict(config_ids)
        own = self._tok.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and vocab_size < own:
            raise ValueError(f"tokenizer.json has {own} tokens but the model's vocab_size is {vocab_size}")
        self._vocab_size = own if vocab_size is None else int(vocab_size)
        self.specials = {k: list(v) for k, v in (specials or {}).items()}
        for key, ids in self.specials.items():
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            if bad:
                raise ValueError(f"{key}={bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        self._tokens = dict(tokens or {})

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        """The tokenizer of an HF model directory; FileNotFoundError when it has no tokenizer.json."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(d)!r} has no tokenizer.json (save one with "
                                    "PreTrainedTokenizerFast(...).save_pretrained(dir)); pass token ids instead")
        vocab = _read_json(d / "config.json").get("vocab_size")
        return cls(path.read_text(encoding="utf-8"), vocab_size=vocab, specials=special_ids(d),
                   tokens=special_tokens(d), files=carried_files(d), config_ids=config_ids(d))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _first(self, key: str) -> int | None:
        ids = self.specials.get(key)
        return ids[0] if ids else None

    @property
    def bos_id(self) -> int | None:
        return self._first("bos_token_id")

    @property
    def eos_id(self) -> int | None:
        """The first EOS id (generation stops at one id; see ``eos_ids`` for all of them)."""
        return self._first("eos_token_id")

    @property
    def eos_ids(self) -> list[int]:
        return list(self.specials.get("eos_token_id", []))

    @property
    def pad_id(self) -> int | None:
        return self._first("pad_token_id")

    @property
    def special_tokens(self) -> dict[str, str]:
        """transformers' ``special_tokens_map``: tokenizer_config.json's strings, else the text of
        the config's bos/eos/pad ids (a directory without tokenizer_config.json)."""
        out = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            i = self._first(key + "_id")
            if i is not None:
                out[key] = self._tok.decode([i], skip_special_tokens=False)
        return {**out, **self._tokens}

    @property
    def chat_template(self) -> str | None:
        return chat_template_in(self.files)

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """``text`` -> ids (T,) int32, with the tokenizer's special tokens (its post-processor)
        unless ``add_special_tokens=False``."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def token_bytes(self, i: int) -> bytes:
        """Token i's own bytes, which its text cannot always show (half of a UTF-8 character): through
        GPT-2's byte alphabet for a byte-level tokenizer, ``<0xNN>`` byte-fallback pieces as their byte,
        else its decoded text. An id past the tokenizer's own tokens (a padded vocabulary) is b''."""
        from tokenizers import decoders

        piece = self._tok.id_to_token(int(i))
        if piece is None:
            return b""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self._tok.decode([int(i)], skip_special_tokens=False).encode("utf-8")

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """ids (T,) -> text; special tokens (EOS padding after generation) are dropped by default."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "json": self._json, "vocab_size": self._vocab_size,
                "specials": self.specials, "special_tokens": self._tokens, "files": self.files,
                "config_ids": self.config_ids}

    @classmethod
    def from_dict(cls, d: dict) -> HFTokenizer:
        if d.get("kind") != cls.kind:
            raise ValueError(f"expected a tokenizer dict of kind {cls.kind!r}, got {d.get('kind')!r}")
        return cls(d["json"], vocab_size=d.get("vocab_size"), specials=d.get("specials"),
                   tokens=d.get("special_tokens"), files=d.get("files"), config_ids=d.get("config_ids"))


def tokenizer_dict(directory: str | Path) -> dict | None:
    """``HFTokenizer.from_dir(directory).to_dict()``, or None when the directory has no tokenizer.json
    (weights alone still convert; sampling then needs token ids)."""
    if not (Path(directory) / "tokenizer.json").is_file():
        return None
    return HFTokenizer.from_dir(directory).to_dict()
