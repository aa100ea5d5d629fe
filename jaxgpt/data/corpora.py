"""Built-in corpora (shipped with the package) and reading text files."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np

CORPORA = ("seed-synthetic", "zh-en")
PAIR_CORPORA = ("zh-en",)
_SYNTHETIC_SENTENCES = (
    "the cat sat on the mat ",
    "the dog ran in the park ",
    "a bird flew over the tree ",
    "the sun is bright today ",
    "hello world this is a test ",
)



# --- Built-in corpora --------------------------------------------------------------------------

def _seed_synthetic_text() -> str:
    # Seed 000 draws the sentences from numpy's global RNG right after np.random.seed(42); a
    # fresh RandomState(42) yields the same draws without touching anyone's global state.
    rng = np.random.RandomState(42)
    parts = ["abcdefg" * 5 + " "] * 200 + ["0123456789" * 3 + " "] * 200
    parts += [_SYNTHETIC_SENTENCES[rng.randint(len(_SYNTHETIC_SENTENCES))] for _ in range(500)]
    return "".join(parts)


def builtin_pairs(name: str = "zh-en") -> list[tuple[str, str]]:
    """The sentence pairs shipped with the package: ``'zh-en'`` = seed 002's 50 zh-en pairs."""
    if name not in PAIR_CORPORA:
        raise ValueError(f"unknown pair corpus {name!r}; available: {PAIR_CORPORA}")
    text = (resources.files("jaxgpt.data") / "corpora" / "zh_en_pairs.tsv").read_text(encoding="utf-8")
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(f"zh_en_pairs.tsv line {lineno}: expected 2 tab-separated fields, "
                             f"got {len(fields)}")
        pairs.append((fields[0], fields[1]))
    return pairs


def builtin_corpus(name: str) -> str:
    """Text of a built-in corpus.

    ``'seed-synthetic'``: seed 000's character corpus (repeated letters, repeated digits, then 500
    random sentences), 25,752 characters. ``'zh-en'``: the pairs as ``zh<TAB>en`` lines.
    """
    if name == "seed-synthetic":
        return _seed_synthetic_text()
    if name == "zh-en":
        return "".join(f"{zh}\t{en}\n" for zh, en in builtin_pairs(name))
    raise ValueError(f"unknown corpus {name!r}; available: {CORPORA}")


# --- Language-model batches --------------------------------------------------------------------

def load_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no text file at {str(p)!r} (resolved to {str(p.resolve())!r})")
    return p.read_text(encoding="utf-8")

