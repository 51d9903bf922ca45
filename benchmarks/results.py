"""One results file per benchmark, newest run first: every script writes through `record`.

    record("benchmarks/CHAOS.md", text)

`text` is one run's report as the scripts make it: a `# Title` line, then its body. The file keeps its own
title (the first run's, or the one it has); the run becomes a section `## <date>: <the run's title>` on
top of the older ones, its own headings one level down. Raw outputs (JSON, logs) go to benchmarks/results/.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

DATE = re.compile(r"20\d\d-\d\d-\d\d(?: \d\d:\d\d UTC)?")
RAW = Path(__file__).resolve().parent / "results"  # JSON and logs beside the tables


def demoted(body: str) -> str:
    """A report's headings one level down, so that they sit under its dated section."""
    return "\n".join("#" + line if line.startswith("#") else line for line in body.splitlines())


def section(text: str, when: str | None = None) -> tuple[str, str]:
    """(the report's title, its dated section): the date is the report's own first one, else now."""
    first, _, body = text.partition("\n")
    title = first.lstrip("#").strip() if first.startswith("#") else "results"
    body = body if first.startswith("#") else text
    found = DATE.search(text)
    when = when or (found.group(0) if found else datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return title, f"## {when}: {title}\n{demoted(body).rstrip()}\n"


def record(path, text: str) -> Path:
    """Put this run's report on top of `path`'s older ones (the file is made with the report's title)."""
    path = Path(path)
    title, new = section(text)
    if path.exists():
        old = path.read_text()
        head, _, rest = old.partition("\n")
        if not head.startswith("# "):
            head, rest = f"# {title}", old
        at = rest.find("\n## ")  # what the file says before its first run stays on top
        intro, runs = (rest[:at], rest[at + 1:]) if at >= 0 else ("", rest)
        intro = f"\n\n{intro.strip()}" if intro.strip() else ""
        out = f"{head}{intro}\n\n{new}\n{runs.lstrip()}"
    else:
        out = f"# {title}\n\n{new}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.rstrip() + "\n")
    return path
