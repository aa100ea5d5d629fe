"""The inference package's shape (issue 52): no block of six or more lines written twice, no function
over 80 lines, and the Engine composed of its parts rather than inheriting them."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import jaxgpt.inference

ROOT = Path(jaxgpt.inference.__file__).parent
WINDOW = 6  # normalised lines that make a repeated block
MAX_FUNCTION_LINES = 80


def _lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the code lines: blank and comment-only lines dropped."""
    out = []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        s = line.strip()
        if s and not s.startswith("#"):
            out.append((no, s))
    return out


def repeated_blocks(root: Path = ROOT, window: int = WINDOW) -> list[str]:
    """Every window of ``window`` consecutive normalised lines that appears at two places in root/*.py,
    as 'file:line and file:line'."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path in sorted(root.glob("*.py")):
        lines = _lines(path)
        for i in range(len(lines) - window + 1):
            seen[tuple(s for _, s in lines[i:i + window])].append((path.name, lines[i][0]))
    return [" and ".join(f"{f}:{n}" for f, n in where) for where in seen.values() if len(where) > 1]


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.name}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_block_of_six_lines_is_repeated():
    found = repeated_blocks()
    assert not found, f"blocks of {WINDOW} lines written twice in jaxgpt/inference/: {found}"


def test_the_checker_finds_a_repeated_block(tmp_path):
    """The checker itself: a block copied into a second file is found, comments and blank lines aside."""
    block = "\n".join(f"x{i} = {i}" for i in range(WINDOW))
    (tmp_path / "a.py").write_text("import os\n" + block + "\n")
    (tmp_path / "b.py").write_text("# c\n" + block.replace("x2 = 2", "x2 = 2  \n\n# note") + "\n")
    assert repeated_blocks(tmp_path) == ["a.py:2 and b.py:2"]
    (tmp_path / "b.py").write_text(block.replace("x3 = 3", "x3 = 4"))
    assert repeated_blocks(tmp_path) == []


def test_no_function_is_over_80_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines in jaxgpt/inference/: {found}"


def test_engine_holds_its_parts_rather_than_inheriting_them():
    from jaxgpt.inference.engine import Engine

    assert Engine.__bases__ == (object,)
