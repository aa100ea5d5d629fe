"""No broken link, figure or path in the repository's markdown.

Every git-tracked ``*.md`` (``git ls-files``; a glob when git is absent) is scanned for relative
link and image targets (``[t](x)``, ``![a](x)``, ``[id]: x``, ``<img src=x>``, ``<a href=x>``):
each must exist in the repository (on disk and, with git, tracked or not ignored), and a
``#anchor`` must name a heading of the target markdown file (GitHub's slugs). Links with a
scheme (http, https, mailto, ...) are not fetched.

README.md and docs/*.md are held to more: paths written in code (inline backticks and fenced
blocks) that start with a top-level directory of the repository (``jaxgpt/nn/attention.py``,
``scripts/demo.py``) must exist; dotted names (``jaxgpt.inference.generate.generate``,
``python -m scripts.x``) must resolve to a module file, and the attribute after it must occur in
that module's source; ``from jaxgpt.x import a, b`` lines in code blocks likewise.

Framework-free and fast (text only; nothing is imported). Also runnable as a script:
``python parity_tests/unit/test_docs_links.py`` prints every problem.
"""
from __future__ import annotations

import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
# top-level directories whose paths, written in code in README/docs, must exist
REPO_DIRS = ("jaxgpt", "torch_ref", "scripts", "parity_tests", "docs", "results", "examples", ".ci")
PACKAGES = ("jaxgpt", "torch_ref", "scripts")  # dotted names under these must resolve
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis", "build",
             "dist", "runs", "out"}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_TARGET = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_TARGET = re.compile(r"<(?:img|a|source|video)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HTML_ID = re.compile(r"<[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
REPO_PATH = re.compile(r"(?<![\w./$~-])((?:%s)/[\w./-]*)" % "|".join(re.escape(d) for d in REPO_DIRS))
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))
RUN_MODULE = re.compile(r"-m\s+((?:%s)(?:\.\w+)*)" % "|".join(PACKAGES))
FROM_IMPORT = re.compile(r"^\s*from\s+((?:%s)(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)\)?\s*(?:#.*)?$" % "|".join(PACKAGES))
OUTPUT_ARG = re.compile(r"(?:--out|--output|--json|-o|>)(?:\s+|=)$")
IMPORT = re.compile(r"^\s*import\s+((?:%s)(?:\.\w+)*)" % "|".join(PACKAGES))


# ---------------------------------------------------------------------------------------- files

def markdown_files(root: Path = ROOT) -> list[Path]:
    """The tracked markdown files (git), or every *.md outside tool/venv folders without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=root, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        files = [root / p for p in out.split("\0") if p]
        return sorted(p for p in files if p.is_file())  # a tracked file deleted in the tree is gone
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in root.rglob("*.md")
                      if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def known_paths(root: Path = ROOT) -> set[str] | None:
    """Files git tracks or would track (not ignored), and their folders; None without git.
    A link to an ignored file (runs/, a local build) would be broken in a fresh clone."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    known: set[str] = set()
    for path in filter(None, out.split("\0")):
        parts = path.split("/")
        known.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return known


def in_repo(target: Path, root: Path, known: set[str] | None) -> bool:
    target = Path(*[p for p in target.parts if p != "."]) if not target.is_absolute() else target
    try:
        rel = target.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return False  # outside the repository: broken for anyone reading it on the forge
    if not (root / rel).exists():
        return False
    return known is None or rel in ("", ".") or rel in known


# ------------------------------------------------------------------------------------- markdown

def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, fenced code lines) as (line number, text); fences themselves are dropped."""
    prose, code, fence = [], [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
                fence = None
            else:
                code.append((no, line))
            continue
        prose.append((no, line))
    return prose, code


def strip_code_spans(line: str) -> str:
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slugify(heading: str) -> str:
    """GitHub's heading anchor: rendered text, lowercased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images -> their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers (not snake_case)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_code(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        out.update(HTML_ID.findall(line))
        m = HEADING.match(line)
        if m:
            slug = slugify(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def link_targets(text: str) -> list[tuple[int, str]]:
    prose, _ = split_code(text)
    out = []
    for no, line in prose:
        bare = strip_code_spans(line)
        for t in INLINE_TARGET.findall(bare) + REF_DEF.findall(bare) + HTML_TARGET.findall(bare):
            out.append((no, t[1:-1] if t.startswith("<") and t.endswith(">") else t))
    return out


def check_links(md: Path, root: Path = ROOT, known: set[str] | None = None, base: Path | None = None) -> list[str]:
    """Problems with the relative link / image targets of one markdown file (relative targets
    resolve against ``base``, by default the file's folder)."""
    problems, base = [], base or md.parent
    rel_md = md.relative_to(root).as_posix() if md.is_relative_to(root) else md.name
    for no, target in link_targets(md.read_text(encoding="utf-8")):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not fetched
        path, _, anchor = target.partition("#")
        path = unquote(path.split("?", 1)[0])
        dest = md if not path else ((root / path.lstrip("/")) if path.startswith("/") else base / path)
        if path and not in_repo(dest, root, known):
            problems.append(f"{rel_md}:{no}: broken link {target!r} (no such file in the repository)")
            continue
        if anchor and dest.suffix.lower() == ".md" and dest.is_file() and unquote(anchor) not in anchors(dest.resolve()):
            problems.append(f"{rel_md}:{no}: broken anchor {target!r} (no heading '#{anchor}' in {dest.name})")
    return problems


# ---------------------------------------------------------------------- paths and names in code

@lru_cache(maxsize=None)
def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def resolve_dotted(name: str, root: Path = ROOT) -> str | None:
    """None when ``a.b.c`` is a module (package/file) followed by attributes that occur in its
    source; otherwise what is wrong."""
    parts = name.split(".")
    cur, module = root / parts[0], None
    if not (cur / "__init__.py").is_file() and not cur.is_dir():
        return f"no package {parts[0]}"
    rest = parts[1:]
    while rest and module is None:
        nxt = cur / rest[0]
        if nxt.is_dir() and ((nxt / "__init__.py").is_file() or any(nxt.glob("*.py"))):
            cur, rest = nxt, rest[1:]
        elif nxt.with_suffix(".py").is_file():
            module, rest = nxt.with_suffix(".py"), rest[1:]
        else:
            break
    module = module or cur / "__init__.py"
    for attr in rest:
        if not module.is_file() or not re.search(r"\b%s\b" % re.escape(attr), _source(module)):
            where = module.relative_to(root).as_posix() if module.is_relative_to(root) else module
            return f"{attr!r} is neither a module nor a name in {where}"
    return None


def code_texts(text: str) -> list[tuple[int, str, bool]]:
    """(line number, code text, in a fenced block) for inline code spans and fenced lines."""
    prose, code = split_code(text)
    out = [(no, m.group(2), False) for no, line in prose for m in CODE_SPAN.finditer(line)]
    return out + [(no, line, True) for no, line in code]


def check_code_refs(md: Path, root: Path = ROOT, known: set[str] | None = None) -> list[str]:
    """Problems with repo paths and jaxgpt/torch_ref/scripts names written in code in ``md``."""
    problems = []
    rel_md = md.relative_to(root).as_posix() if md.is_relative_to(root) else md.name
    for no, code, fenced in code_texts(md.read_text(encoding="utf-8")):
        for m in REPO_PATH.finditer(code):
            path = m.group(1).rstrip(".,:;")
            if code[m.end():m.end() + 1] in ("<", "{", "*", "$", "[") or "<" in path:
                continue  # a pattern (results/<name>/, decode.{json,md}), not a path
            if OUTPUT_ARG.search(code[:m.start()]):
                continue  # what a command will write (--out results/engine/decode_b8)
            if not in_repo(root / path, root, known):
                problems.append(f"{rel_md}:{no}: `{path}` does not exist")
        names = set(DOTTED.findall(code)) | set(RUN_MODULE.findall(code))
        if fenced:
            m = FROM_IMPORT.match(code)
            if m:
                names |= {f"{m.group(1)}.{n.split()[0]}" for n in m.group(2).split(",") if n.strip()}
            m = IMPORT.match(code)
            if m:
                names.add(m.group(1))
        for name in sorted(names):
            if name.endswith((".py", ".md", ".json", ".txt", ".pt")):
                continue  # a file name written with dots, covered by the path check
            why = resolve_dotted(name, root)
            if why:
                problems.append(f"{rel_md}:{no}: `{name}`: {why}")
    return problems


def strict_files(files: list[Path], root: Path = ROOT) -> list[Path]:
    return [p for p in files if p == root / "README.md" or (p.parent == root / "docs" and p.suffix == ".md")]


def all_problems(root: Path = ROOT) -> list[str]:
    files, known = markdown_files(root), known_paths(root)
    problems = [p for md in files for p in check_links(md, root, known)]
    return problems + [p for md in strict_files(files, root) for p in check_code_refs(md, root, known)]


# ----------------------------------------------------------------------------------------- tests

def test_markdown_is_found():
    files = markdown_files()
    assert ROOT / "README.md" in files and strict_files(files), files


def test_no_broken_links_in_tracked_markdown():
    files, known = markdown_files(), known_paths()
    problems = [p for md in files for p in check_links(md, ROOT, known)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_paths_and_names_in_readme_and_docs_exist():
    files, known = markdown_files(), known_paths()
    problems = [p for md in strict_files(files) for p in check_code_refs(md, ROOT, known)]
    assert not problems, "stale paths or names in code:\n" + "\n".join(problems)


def test_the_checker_catches_breakage(tmp_path):
    """A synthetic repository: every kind of breakage is reported, and the good links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "x").mkdir(parents=True)
    (tmp_path / "results" / "x" / "fig.png").write_bytes(b"png")
    pkg = tmp_path / "jaxgpt" / "nn"
    pkg.mkdir(parents=True)
    (tmp_path / "jaxgpt" / "__init__.py").write_text("def build(): ...\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "attention.py").write_text("def scaled_dot_product_attention(): ...\n")
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Checked mode\n\ntext\n")
    readme = tmp_path / "README.md"
    readme.write_text("\n".join([
        "# Title",
        "## Good `code` heading",
        "[ok](docs/guide.md) [ok anchor](docs/guide.md#checked-mode) [self](#good-code-heading)",
        "![ok fig](results/x/fig.png) [web](https://example.com/nowhere) <mailto:a@b.c>",
        "[bad](docs/missing.md) ![bad fig](results/x/nofig.png) [bad anchor](docs/guide.md#nope)",
        "[bad self](#no-such-heading) [outside](../elsewhere/file.md)",
        "`[not a link](elsewhere/ignored-in-code.md)`",
        "[ref]: docs/gone.md",
        '<img src="results/x/gone.png">',
        "`jaxgpt/nn/attention.py` `jaxgpt/attention.py` `results/<name>/` `scripts/exp.py --smoke`",
        "`jaxgpt.nn.attention.scaled_dot_product_attention` `jaxgpt.build` `jaxgpt.generate.generate`",
        "```python",
        "from jaxgpt.nn.attention import scaled_dot_product_attention, Attention",
        "from jaxgpt.block import Block",
        "[code link](elsewhere/ignored.md)",
        "```",
        "```bash",
        "python -m scripts.experiments.minigpt --smoke --out results/new_run   # and torch_ref/nope.py",
        "```",
    ]) + "\n")
    got = check_links(readme, tmp_path, None) + check_code_refs(readme, tmp_path, None)
    text = "\n".join(got)
    for broken in ["docs/missing.md", "results/x/nofig.png", "docs/guide.md#nope", "#no-such-heading",
                   "../elsewhere/file.md", "docs/gone.md", "results/x/gone.png", "`jaxgpt/attention.py`",
                   "`scripts/exp.py`", "`jaxgpt.generate.generate`", "'Attention'", "`jaxgpt.block.Block`",
                   "`scripts.experiments.minigpt`", "`torch_ref/nope.py`", "`jaxgpt.block`"]:
        assert broken in text, f"{broken} not reported:\n{text}"
    for fine in ["docs/guide.md'", "checked-mode", "good-code-heading", "'results/x/fig.png'", "example.com", "a@b.c",
                 "ignored", "`jaxgpt/nn/attention.py`", "results/<name>", "`jaxgpt.build`",
                 "jaxgpt.nn.attention.scaled_dot_product_attention`"]:
        assert fine not in text, f"{fine} reported although it is fine:\n{text}"
    assert len(got) == 15, text
    # the same file passes once the breakage is removed
    lines = readme.read_text().splitlines()
    readme.write_text("\n".join(lines[:4] + ["`jaxgpt/nn/attention.py` `jaxgpt.build`"]) + "\n")
    assert check_links(readme, tmp_path, None) + check_code_refs(readme, tmp_path, None) == []


def test_a_broken_link_in_a_copy_of_the_readme_is_caught(tmp_path):
    """The real README, copied with one link broken, checked as if it lay in the repository root."""
    copy = tmp_path / "README.md"
    copy.write_text(ROOT.joinpath("README.md").read_text(encoding="utf-8")
                    + "\n[broken](docs/this-page-does-not-exist.md) ![gone](results/no-such-figure.png)\n",
                    encoding="utf-8")
    problems = check_links(copy, ROOT, None, base=ROOT)
    assert [p for p in problems if "this-page-does-not-exist" in p or "no-such-figure" in p] == [
        p for p in problems if p.split(": ", 1)[0].endswith(str(len(copy.read_text().splitlines())))], problems
    assert sum("this-page-does-not-exist" in p or "no-such-figure" in p for p in problems) == 2, problems


def test_github_slugs():
    assert slugify("Parity on your own checkpoints (`jaxgpt parity`)") == "parity-on-your-own-checkpoints-jaxgpt-parity"
    assert slugify("Profile: where the time goes") == "profile-where-the-time-goes"
    assert slugify("`scan_layers` and *remat*") == "scan_layers-and-remat"


if __name__ == "__main__":
    found = all_problems()
    print("\n".join(found) or "no problems")
    sys.exit(1 if found else 0)
