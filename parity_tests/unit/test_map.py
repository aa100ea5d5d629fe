"""The repository's map cannot drift: every module under ``jaxgpt/`` is named in docs/layout.md's "Where
things are" table (in the row of its folder, or of the nearest listed folder above it), and every
``jaxgpt <command>`` the README and docs/ write is a subcommand the CLI has. Text only, fast."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _map_rows() -> dict[str, str]:
    """docs/layout.md's "Where things are" table: folder (as linked, 'jaxgpt/nn') -> the row's text; the
    package's own top-level modules ('jaxgpt') may be named anywhere in the table."""
    section = LAYOUT.split("# Where things are", 1)[1].split("\n## ", 1)[0]
    rows = {"jaxgpt": section}
    for line in section.splitlines():
        m = re.match(r"\|\s*\[`([\w/]+)/`\]", line)
        if m:
            rows[m.group(1)] = line
    return rows


def _unmapped() -> list[str]:
    rows, missing = _map_rows(), []
    for py in sorted((ROOT / "jaxgpt").rglob("*.py")):
        rel = py.relative_to(ROOT)
        if py.name == "__init__.py" or "__pycache__" in rel.parts:
            continue
        folder = next((p.as_posix() for p in rel.parents if p.as_posix() in rows), None)
        row = rows.get(folder, "")
        below = rel.relative_to(folder).as_posix() if folder else rel.as_posix()  # 'kernels/blocked.py' under jaxgpt/nn
        if not any(name in row for name in (f"`{below}`", f"`{py.name}`", f"{py.stem}.py", f"`{py.stem}`")):
            missing.append(f"{rel} (folder row: {folder or 'none'})")
    return missing


def test_every_module_is_on_the_map():
    assert not _unmapped(), "modules missing from docs/layout.md's 'Where things are' table:\n  " + "\n  ".join(_unmapped())


def _subcommands() -> set[str]:
    src = (ROOT / "jaxgpt" / "cli" / "__init__.py").read_text()
    names = set(re.findall(r"sub\.add_parser\(\"(\w+)\"", src))
    names |= {m for m in re.findall(r"add_(\w+)_parser", src)}  # the commands with a module of their own
    return names


def _commands_written() -> dict[str, str]:
    """``jaxgpt X`` as written in code: command lines of fenced blocks (``jaxgpt``, ``.venv/bin/jaxgpt``,
    ``python -m jaxgpt``) and inline code spans that start with it -> the first file writing it."""
    command = re.compile(r"^\s*(?:\S*/)?(?:python3? -m )?jaxgpt ([a-z][\w-]*)")
    written = {}
    for doc in DOCS:
        fenced = False
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
                continue
            spans = [line] if fenced else re.findall(r"`([^`]+)`", line)
            for span in spans:
                m = command.match(span)
                if m:
                    written.setdefault(m.group(1), doc.relative_to(ROOT).as_posix())
    return written


def test_every_command_written_exists():
    commands = _subcommands()
    assert {"train", "sample", "eval", "convert", "bench", "parity", "prepare", "serve"} <= commands, commands
    written = _commands_written()
    assert {"train", "sample", "serve"} <= set(written), written  # the parser reads the README's commands
    unknown = {w: where for w, where in written.items() if w not in commands}
    assert not unknown, f"`jaxgpt <command>` written for commands the CLI does not have: {unknown}"
