"""No comment or docstring in jaxgpt/ quotes a timing, a speed-up, a load figure, a date or an incident:
a comment says why in one sentence and links docs/performance.md, where the numbers live with the
script that measured them. Scanned: Python comments and docstrings, and the C++ kernels' comments
(``//`` and ``/* */``), read as text (nothing is imported).

The allowlist names the files whose figures other helpers are removing; a file that has none left
fails the test until it leaves the list.
"""
from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxgpt"

class _All:
    """Found where every one of its patterns is found."""

    def __init__(self, *patterns: re.Pattern):
        self.patterns = patterns

    def search(self, text: str) -> bool:
        return all(p.search(text) for p in self.patterns)


_NUMBER = r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# A speed-up ratio (1.2x, 2.5-2.8x) counts only beside a word about speed: "a 4x MLP" is a size.
_SPEED = r"faster|slower|\bfast\b|\bslow\b|speed|quicker|throughput|tokens/s|\bwins?\b|\bmeasured\b|\bstep\b"
PATTERNS = {
    # 3.3 ms, 33 us, 1,008 tokens/s, 28 GB/s, 40 s (seconds need a space: "401s" is a status code; 0 s is no timing)
    "timing": re.compile(rf"{_NUMBER}\s*(?:ms|us|µs|ns|tok/s|tokens/s|tokens a second|[GMK]B/s|[GT]FLOP/s|it/s)(?![\w/])"
                         rf"|(?<![\w.,])(?!0\s)(?:\d+)(?:\.\d+)?\s+(?:s|sec|seconds?|min|minutes?|hours?)\b(?!\()"),
    "speed-up": _All(re.compile(rf"{_NUMBER}(?:-\d+(?:\.\d+)?)?x\b(?![\d(])"), re.compile(_SPEED, re.I)),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    # "measured 1.2x", "Measured on 2 cores": a number near the word, in the same clause ("AVX-512" is a name)
    "measured figure": re.compile(r"\b[Mm]easured\b[^.;]{0,40}?(?<![\w-])\d|(?<![\w-])\d[^.;()]{0,40}?\b[Mm]easured\b"),
    "incident": re.compile(r"\bincidents?\b", re.I),
    "load": re.compile(r"\bload(?: average)?(?: of)? \d|\b\d+-minute load\b", re.I),
}

# Files allowed to quote figures, with at most how many lines each may keep: none (issue 52).
KNOWN: dict[str, int] = {}


def python_text(source: str):
    """(line number, text) of every comment and docstring line of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                for i, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + i, line


def cpp_text(source: str):
    """(line number, text) of every comment line of a C++ source (code outside comments is left out)."""
    in_block = False
    for number, line in enumerate(source.splitlines(), 1):
        if in_block:
            yield number, line
            in_block = "*/" not in line
        elif "/*" in line:
            yield number, line[line.index("/*"):]
            in_block = "*/" not in line[line.index("/*"):]
        elif "//" in line:
            yield number, line[line.index("//"):]


def hits(path: Path, source: str) -> list[str]:
    """One 'path:line: [kinds] text' per comment or docstring line that quotes a figure."""
    if not any(p.search(line) for line in source.splitlines() for p in PATTERNS.values()):
        return []  # nothing in the raw text, so nothing in its comments: no need to parse it
    lines = python_text(source) if path.suffix == ".py" else cpp_text(source)
    out = []
    for number, text in sorted(set(lines)):
        kinds = [kind for kind, pattern in PATTERNS.items() if pattern.search(text)]
        if kinds:
            out.append(f"{path.relative_to(ROOT).as_posix()}:{number}: [{', '.join(kinds)}] {text.strip()}")
    return out


@functools.cache
def found() -> dict[str, list[str]]:
    """{path: its lines with figures} over jaxgpt/'s Python and C++ sources."""
    out = {}
    for path in sorted(p for ext in ("*.py", "*.cc", "*.h") for p in PACKAGE.rglob(ext)):
        lines = hits(path, path.read_text(encoding="utf-8"))
        if lines:
            out[path.relative_to(ROOT).as_posix()] = lines
    return out


def test_no_timing_or_date_in_comments():
    new = [line for f, lines in found().items() if len(lines) > KNOWN.get(f, 0) for line in lines]
    assert not new, ("comments and docstrings in jaxgpt/ give the reason in one sentence and link "
                     "docs/performance.md for the numbers:\n" + "\n".join(new))


def test_allowlist_names_only_files_with_figures():
    clean = sorted(f for f in KNOWN if f not in found())
    assert not clean, "no figure left, so remove from KNOWN: " + ", ".join(clean)


def test_the_patterns_hit_figures_and_miss_shapes_and_code():
    def flagged(text):
        return [k for k, p in PATTERNS.items() if p.search(text)]

    for text in ("# 3.3 ms a step", "# 1,008-token decoding 449 -> 652 tokens/s", "# about 28 GB/s",
                 "# after 40 s", "# 1.2x faster", "# 2.5-2.8x faster than XLA", "# measured 1.2x",
                 "# seen in CI, 2026-11-25", "# the incident of", "# load 0.5 before", "# 33 us per buffer",
                 "# Measured on 2 cores only", "# measured splitting from 64K weights"):
        assert flagged(text), text
    for text in ("# (B, T, H, D)", "# a 4x two-matrix MLP", "# 401s and timeouts are logged too",
                 "# no division by a 0 s fake time", "# 2 x 4 tiles", "# measured once and cached on disk",
                 "# fails by 20x", "# 1e-5 max abs", "# shape (4, 128)", "# B 12 x 1024 bf16",
                 "# T a multiple of 128; no TPU measured", "# the AVX-512 tiles are the ones measured there"):
        assert not flagged(text), (text, flagged(text))
    assert [n for n, _ in cpp_text("int a; // 3 ms\n/* one\n 2 ms */ int b;\nint c = 3;  \n")] == [1, 2, 3]
