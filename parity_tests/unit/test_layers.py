"""jaxgpt's shape, read from its source with ``ast`` (no import runs): the import graph has no circle and
no upward arrow against the layer order below, and no function is over 80 lines.

Imports at module level and inside functions are both arrows, reported apart (an import inside a function
hides a circle from Python, not from a reader). The allowlists name today's exceptions, each with whoever
removes it; an exception that is gone fails the test too, so the lists shrink as the code is fixed.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxgpt"

# Lowest first; a module belongs to the layer of its longest matching prefix, and may import from its own layer
# or any lower one. Peers share a row (train and inference never import each other; neither do parallel and data).
LAYERS = (
    ("jaxgpt.config",),  # frozen, framework-free configs
    ("jaxgpt.core",),  # what the two frameworks share: layout, constants, validation
    ("jaxgpt.parallel", "jaxgpt.data"),  # meshes and devices; tokenizers, corpora, token files, batches
    ("jaxgpt.nn.kernels",),  # every speed path behind a few ops; the execution policy per target platform
    ("jaxgpt.nn",),  # the layers
    ("jaxgpt.models",),  # the networks
    ("jaxgpt.train", "jaxgpt.inference"),  # training; generation, the engine, the server
    ("jaxgpt.convert",),  # weights in and out (reads and writes run directories: train.checkpoint)
    ("jaxgpt.tools", "jaxgpt.testing", "jaxgpt.nnx"),  # parity and bench, the parity kit, NNX modules
    ("jaxgpt.cli",),  # the jaxgpt command
    ("jaxgpt",),  # the package's facade (jaxgpt/__init__.py, __main__.py)
)

# Known exceptions, each (importer, imported, 'module' | 'function'), with who removes it. The lead empties
# this list as the branches merge; an entry whose arrow is gone fails test_allowlists_name_only_what_exists.
KNOWN_UPWARD: set = set()
# Known circles, as the set of modules each one runs through (arrows of both kinds, the allowlisted upward
# arrows left out: each of those already closes its own circle and is reported above).
KNOWN_CIRCLES: set = set()
# Functions over MAX_LINES today (path::qualified name), each being split by the helper named.
MAX_LINES = 80
KNOWN_LONG: set = set()


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict) -> list[str]:
    """The jaxgpt modules an import statement loads: the named submodule where one exists, else its package."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for target in names:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def _imports(node: ast.AST, where: str = "module"):
    """(import statement, 'module' | 'function') for every import under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(child, "function" if inner else where)


@functools.cache
def import_graph(package: Path = PACKAGE) -> dict[tuple[str, str], set[str]]:
    """{(importer, imported): {'module', 'function'}} over jaxgpt's modules; 'function': inside a def or lambda."""
    known, edges = modules(package), defaultdict(set)
    for name, path in known.items():
        for node, where in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(name, path.name == "__init__.py", node, known):
                edges[(name, target)].add(where)
    return dict(edges)


def layer(module: str) -> int:
    best = max((len(p), i) for i, row in enumerate(LAYERS) for p in row if module == p or module.startswith(p + "."))
    return best[1]


def upward(edges) -> set[tuple[str, str, str]]:
    return {(a, b, where) for (a, b), wheres in edges.items() for where in wheres if layer(a) < layer(b)}


def circles(edges, skip=frozenset()) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan), over every arrow not in ``skip``."""
    graph = defaultdict(set)
    for (a, b), wheres in edges.items():
        if any((a, b, w) not in skip for w in wheres):
            graph[a].add(b)
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on.difference_update(component)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def _functions(node: ast.AST, prefix: str = ""):
    """(qualified name, def node) for every function under ``node``, methods and nested functions too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not isinstance(child, ast.ClassDef):
                yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


@functools.cache
def long_functions() -> dict[str, int]:
    """{'path::qualified name': lines} for every function in jaxgpt/ over MAX_LINES (its def to its last line)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for qualname, node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            if node.end_lineno - node.lineno + 1 > MAX_LINES:
                out[f"{path.relative_to(ROOT).as_posix()}::{qualname}"] = node.end_lineno - node.lineno + 1
    return out


def _listing(arrows) -> str:
    return "\n".join(f"  {a} -> {b} ({where}: layer {layer(a)} imports layer {layer(b)})" for a, b, where in arrows)


def test_every_module_has_a_layer():
    assert all(layer(m) >= 0 for m in modules())  # max() over an empty row list raises for one that has none


def test_no_upward_arrow():
    """An arrow from a lower layer to a higher one, at module level or inside a function, not in KNOWN_UPWARD."""
    new = upward(import_graph()) - KNOWN_UPWARD
    module = sorted(e for e in new if e[2] == "module")
    function = sorted(e for e in new if e[2] == "function")
    assert not new, ("upward imports (LAYERS in this file, lowest first):\n"
                     + (f"at module level:\n{_listing(module)}\n" if module else "")
                     + (f"inside functions:\n{_listing(function)}\n" if function else ""))


def test_no_import_circle():
    edges = import_graph()
    new = [c for c in circles(edges, KNOWN_UPWARD) if c not in KNOWN_CIRCLES]
    lines = []
    for c in new:
        arrows = sorted((a, b, ", ".join(sorted(w))) for (a, b), w in edges.items() if a in c and b in c)
        lines.append(" <-> ".join(sorted(c)) + "\n" + "\n".join(f"  {a} -> {b} ({w})" for a, b, w in arrows))
    assert not new, "import circles:\n" + "\n".join(lines)


def test_no_function_over_80_lines():
    over = {k: n for k, n in long_functions().items() if k not in KNOWN_LONG}
    assert not over, f"functions over {MAX_LINES} lines (split them):\n" + "\n".join(
        f"  {k}: {n} lines" for k, n in sorted(over.items()))


def test_allowlists_name_only_what_exists():
    """A fixed exception leaves the allowlist with it: each entry must still be true."""
    edges = import_graph()
    gone = sorted(f"upward {a} -> {b} ({w})" for a, b, w in KNOWN_UPWARD - upward(edges))
    found = circles(edges, KNOWN_UPWARD)
    gone += sorted(" <-> ".join(sorted(c)) for c in KNOWN_CIRCLES if c not in found)
    gone += sorted(f"long function {k}" for k in KNOWN_LONG - set(long_functions()))
    assert not gone, "fixed, so remove from this file's allowlists:\n  " + "\n  ".join(gone)


def test_the_graph_sees_both_kinds_of_import_and_relative_ones(tmp_path):
    """The reader itself, on a tiny package: module-level, function-level and relative imports, a circle."""
    pkg = tmp_path / "jaxgpt"
    (pkg / "config").mkdir(parents=True)
    (pkg / "nn").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("def f():\n    from jaxgpt.nn import mlp\n")
    (pkg / "nn" / "__init__.py").write_text("from . import mlp\n")
    (pkg / "nn" / "mlp.py").write_text("from jaxgpt.config import f\nfrom .. import nn\n")
    edges = import_graph(pkg)
    assert edges == {("jaxgpt.config", "jaxgpt.nn.mlp"): {"function"}, ("jaxgpt.nn", "jaxgpt.nn.mlp"): {"module"},
                     ("jaxgpt.nn.mlp", "jaxgpt.config"): {"module"}, ("jaxgpt.nn.mlp", "jaxgpt.nn"): {"module"}}
    assert upward(edges) == {("jaxgpt.config", "jaxgpt.nn.mlp", "function")}
    assert circles(edges) == [frozenset({"jaxgpt.config", "jaxgpt.nn", "jaxgpt.nn.mlp"})]
    assert circles(edges, skip={("jaxgpt.config", "jaxgpt.nn.mlp", "function")}) == [
        frozenset({"jaxgpt.nn", "jaxgpt.nn.mlp"})]
