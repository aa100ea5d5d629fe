"""scripts/experiments/run_experiments.py's collection step (self-contained, no training): every experiment's
claimed-vs-measured rows, in whichever shape its JSON stores them, end up in results/CLAIMS.md."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts.experiments import run_experiments


def _write(root: Path, name: str, data: dict) -> None:
    (root / name).mkdir(parents=True)
    (root / name / f"{name}.json").write_text(json.dumps({"wall_s": 12.5, **data}))
    (root / name / "README.md").write_text(f"# {name}\n\n![loss]({name}.png) [json]({name}.json) "
                                           "[docs](../../docs/x.md) [web](https://example.org/a.png) [top](#top)\n")


def test_collect_writes_every_claim_row(tmp_path):
    _write(tmp_path, "attention_basics", {"claims": [
        {"seed": "000", "claim": "a | b", "measured": "1", "verdict": "holds"},
        {"seed": "003", "claim": "c", "measured": "2", "verdict": "does not hold (measured 2)"}]})
    _write(tmp_path, "attnres", {"claims": {"accuracy": {"full": 0.88}},  # the seed's numbers, not rows
                                 "claim_rows": [{"source": "seed 002", "claim": "d", "measured": "3",
                                                 "verdict": "not measurable here (why)"}]})
    _write(tmp_path, "shakespeare", {"claims": [["e", "1.88", "1.91", "holds for the recipe"]]})
    assert run_experiments.main.__name__  # the module imports without running anything
    sys.argv = ["run_experiments.py", "--collect", "--out", str(tmp_path)]
    assert run_experiments.main() == 0
    text = (tmp_path / "CLAIMS.md").read_text()
    assert "does not hold 1, holds 2, not measurable here 1" in text
    assert "| seed 000 | a \\| b | 1 | holds |" in text
    assert "| seed 002 | d | 3 | not measurable here (why) |" in text
    assert "| e | 1.91 (claimed: 1.88) | holds for the recipe |" in text
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "## attention_basics (12.5 s)" in summary and "## minigpt (not run)\n\n(no results)" in summary
    # the READMEs' relative links, rebased from results/<name>/ onto results/ (where SUMMARY.md is)
    assert ("![loss](attnres/attnres.png) [json](attnres/attnres.json) [docs](attnres/../../docs/x.md) "
            "[web](https://example.org/a.png) [top](#top)") in summary
