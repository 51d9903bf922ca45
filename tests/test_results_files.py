"""One results file per benchmark, each run a dated section, newest first (benchmarks/results.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from results import DATE, record  # noqa: E402

SECTION = re.compile(r"^## (20\d\d-\d\d-\d\d(?: \d\d:\d\d UTC)?): ", re.M)


def test_a_run_goes_on_top_of_the_older_ones_with_its_headings_one_level_down(tmp_path):
    out = tmp_path / "X.md"
    record(out, "# Speed\n\n- date: 2026-11-01 10:00 UTC\n\n## Targets\n\n| a |\n")
    out.write_text(out.read_text().replace("# Speed\n", "# Speed\n\nWhat the file is about.\n", 1))
    record(out, "# Speed, again\n\n`cmd`, 2026-12-02 09:30 UTC\n\n## Targets\n\n| b |\n")
    text = out.read_text()
    assert text.startswith("# Speed\n\nWhat the file is about.\n\n## 2026-12-02")  # its title and intro stay on top
    assert SECTION.findall(text) == ["2026-12-02 09:30 UTC", "2026-11-01 10:00 UTC"]
    assert text.count("### Targets") == 2 and "\n## Targets" not in text
    assert text.index("| b |") < text.index("| a |")


def test_each_benchmark_has_one_results_file_whose_runs_are_dated_newest_first():
    files = sorted(p for p in (ROOT / "benchmarks").glob("*.md") if p.name != "README.md")
    assert len(files) <= 26, [p.name for p in files]  # one per benchmark, not one per run
    for path in files:
        text = path.read_text()
        dates = SECTION.findall(text)
        assert dates or DATE.search(text), f"{path.name} says nowhere when it was measured"
        days = [d[:10] for d in dates]
        assert days == sorted(days, reverse=True), f"{path.name}: sections not newest first: {days}"
