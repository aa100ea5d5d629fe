"""The committed result tables say what they measured: no cell of a markdown table in results/ or
docs/ is a NaN (``nan``, ``nanx``, ``NaN%``: an arm that did not run, formatted as a number), and
every serving benchmark table (bench_serving's ``results/engine/serving*.md``) says per arm whether
its tokens were checked against transformers' ``generate`` (``n/32``, or ``not checked`` when no
hf-one arm ran), never a bare ``-``. Text only, nothing imported: fast."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a whole cell that is a NaN, with or without a unit or sign ('| nanx |', '| -nan |', '| NaN% |')
NAN_CELL = re.compile(r"\|\s*[-+]?nan(?:x|%|\s*(?:ms|s|[KMG]i?B|tok/s))?\s*(?=\|)", re.IGNORECASE)


def table_rows(path: Path):
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("|"):
            yield i, line


def nan_cells(paths) -> list[str]:
    return [f"{p}:{i}: {line.strip()[:160]}" for p in paths for i, line in table_rows(p) if NAN_CELL.search(line)]


def test_no_table_cell_is_nan():
    paths = sorted((ROOT / "results").rglob("*.md")) + sorted((ROOT / "docs").rglob("*.md"))
    assert len(paths) > 20
    bad = nan_cells(paths)
    assert not bad, "NaN cells (write 'not run' or the number):\n" + "\n".join(bad)


def test_the_nan_check_sees_nan_cells(tmp_path):
    """The detector itself: it flags what bench_train used to write and passes prose and real numbers."""
    good = tmp_path / "good.md"
    good.write_text("| a | b |\n|---|---|\n| nanoGPT | not run |\n| grad norm nan in a message | 1.2x |\n")
    bad = tmp_path / "bad.md"
    bad.write_text("| a | b |\n|---|---|\n| jaxgpt | nanx |\n| x | NaN% |\n| nan ms | 3 |\n")
    assert nan_cells([good]) == [] and len(nan_cells([bad])) == 3


def test_serving_tables_say_whether_tokens_were_checked():
    paths = sorted((ROOT / "results" / "engine").rglob("serving*.md"))  # archive/ too
    assert paths
    for p in paths:
        rows = list(table_rows(p))
        header = [c.strip() for c in rows[0][1].strip().strip("|").split("|")]
        col = header.index("tokens = hf-one")
        for i, line in rows[2:]:
            cell = line.strip().strip("|").split("|")[col].strip()
            assert re.fullmatch(r"\d+/\d+|not checked", cell), f"{p.relative_to(ROOT)}:{i}: tokens cell {cell!r}"
