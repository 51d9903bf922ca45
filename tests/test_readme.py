"""Every command of the README and jobs/README.md runs as written.

A newcomer pastes them from the repository's root: each `bash` and `python` block is run as it
stands, the blocks of one section in order in one fresh folder (so a later block may use what an
earlier one wrote, as a reader's would), with the repository's hostfiles/, examples/, jobs/ and
benchmarks/ beside it. A block that cannot run on one machine without a GPU, root or other hosts
says so on the line before it: `<!-- not run by tests/test_readme.py: REASON -->`; one for one MPI
implementation says `<!-- run by tests/test_readme.py under Open MPI only -->` (CI runs the suite
under each; under Open MPI only the README's sections and the blocks written for it). Under Open MPI every command runs with what its README section says to set as root
and on 2 cores (mpiimpl.local_env). Output samples are `text` blocks. Figures the README quotes come from results files in benchmarks/ with a date.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import child_env, launcher, mpi_impl

from mpitrain.launch import mpiimpl

ROOT = Path(__file__).resolve().parent.parent
# The front page, the job scripts' page and the documentation site's pages (docs/*.md; the folders
# linked in docs/ are the repository's own, read where they are).
DOCS = ("README.md", "jobs/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
RUNNABLE = ("bash", "python")
LANGUAGES = RUNNABLE + ("text",)
NOT_RUN = re.compile(r"^\s*<!-- not run by tests/test_readme.py: (?P<why>.+\S) -->\s*$")
ONLY = re.compile(r"^\s*<!-- run by tests/test_readme.py under (?P<title>.+\S) only -->\s*$")
# An example that trains says what a user should see, and is held to it: every "test accuracy X" it
# prints (each run's summary) must be at least the figure (the npz example once said "done" at 0.19).
CHECKS = re.compile(r"^\s*<!-- tests/test_readme.py checks: test accuracy >= (?P<least>[0-9.]+) -->\s*$")
# A Python block a page says runs on every rank of an mpirun is run there too, as a file, with the
# same checks: `mpirun -np N python block.py` (docs/api.md's once crashed on its workers).
UNDER_MPIRUN = re.compile(r"^\s*<!-- tests/test_readme.py runs it under mpirun -np (?P<np>\d+) too -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
SHARED = ("hostfiles", "examples", "jobs", "benchmarks")  # repo-relative paths the commands name
SECTION_TIMEOUT_S = 600  # a hang fails; the slowest section (6 ranks on 2 cores) takes ~1 min


def blocks(doc: str) -> list[dict]:
    """Every fenced block: its line, section, language, code and why it is not run (or None)."""
    lines = (ROOT / doc).read_text().splitlines()
    found, section, i = [], doc, 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = f"{doc}: {lines[i][3:].strip()}"
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        markers = []  # the comment lines right above the block, each one marker
        for ln in reversed(lines[:start]):
            if ln.strip().startswith("<!--"):
                markers.append(ln)
            elif ln.strip():
                break
        def marked(rx):
            return next((m for m in map(rx.match, markers) if m), None)
        why, only, checks, mpirun = marked(NOT_RUN), marked(ONLY), marked(CHECKS), marked(UNDER_MPIRUN)
        found.append({"doc": doc, "line": start + 1, "section": section, "lang": m["lang"],
                      "code": textwrap.dedent("\n".join(body)) + "\n", "not_run": why["why"] if why else None,
                      "only": only["title"] if only else None,
                      "least_accuracy": float(checks["least"]) if checks else None,
                      "mpirun_np": int(mpirun["np"]) if mpirun else None})
        i += 1
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]
SECTIONS: dict[str, list[dict]] = {}
for _b in ALL:
    if _b["lang"] in RUNNABLE and _b["not_run"] is None:
        SECTIONS.setdefault(_b["section"], []).append(_b)


def test_every_block_is_run_or_says_why_not():
    titles = {impl.title for impl in mpiimpl.IMPLS.values()}
    assert {b["only"] for b in ALL if b["only"]} <= titles, "'under X only' names an MPI: MPICH or Open MPI"
    unlabelled = [f"{b['doc']}:{b['line']}" for b in ALL if b["lang"] not in LANGUAGES]
    assert not unlabelled, f"label these blocks bash, python or text: {unlabelled}"
    marked_text = [f"{b['doc']}:{b['line']}" for b in ALL if b["lang"] == "text" and b["not_run"]]
    assert not marked_text, f"a text block is never run; the marker belongs before a command: {marked_text}"
    runnable = [b for s in SECTIONS.values() for b in s]
    assert len(runnable) >= 8, f"only {len(runnable)} blocks would run"  # a parser that finds nothing fails
    assert {"README.md: The main job", "docs/checkpoints.md: Checkpoints and resuming", "README.md: Python API",
            "README.md: Your own data"} <= set(SECTIONS)
    assert any(b["lang"] == "python" for b in runnable)
    checked = [f"{b['doc']}:{b['line']}" for b in ALL if b["least_accuracy"] is not None]
    assert len(checked) >= 3, checked  # the main job, your own data, the API at least
    # A page that says its Python runs on every rank of an mpirun shows it so (docs/api.md's did not)
    says_mpirun = {b["doc"] for b in ALL if b["lang"] == "python" and "rank()" in b["code"]}
    assert says_mpirun <= {b["doc"] for b in ALL if b["mpirun_np"]}, says_mpirun


def run_block(block: dict, folder: Path, np_: int | None = None) -> subprocess.CompletedProcess:
    env = {**child_env(), **mpiimpl.local_env(mpi_impl(), spawns="--respawn" in block["code"])}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python, mpirun, mpitrain
    if block["lang"] == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block["code"]]
    elif np_:
        (folder / "block.py").write_text(block["code"])
        cmd = [*launcher(), "-np", str(np_), sys.executable, "block.py"]
    else:
        cmd = [sys.executable, "-c", block["code"]]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=SECTION_TIMEOUT_S)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_commands_of_each_section_run_as_written(section, tmp_path):
    for name in SHARED:
        (tmp_path / name).symlink_to(ROOT / name)
    blocks_here = [b for b in SECTIONS[section] if b["only"] in (None, mpi_impl().title)]
    if not blocks_here:
        pytest.skip(f"{mpi_impl().title} runs no block of this section (they are for another MPI)")
    if mpi_impl().name != "mpich" and not section.startswith("README.md") and \
            not any(b["only"] == mpi_impl().title for b in blocks_here):
        # A newcomer's first commands (the README's) run under both MPIs, and every block written
        # for one MPI under it; docs/ pages show mpitrain's flags, whose MPI calls those make too.
        pytest.skip(f"the docs' commands run under MPICH; under {mpi_impl().title}: the README's and its own blocks")
    runs = [(b, None) for b in blocks_here] + [(b, b["mpirun_np"]) for b in blocks_here if b["mpirun_np"]]
    for block, np_ in runs:
        folder = tmp_path
        if np_:  # a reader's second try, under mpirun: a folder of its own (its checkpoints are not the first's)
            folder = tmp_path / f"under-mpirun-{block['line']}"
            folder.mkdir()
            for name in SHARED:
                (folder / name).symlink_to(ROOT / name)
        proc = run_block(block, folder, np_)
        where = f"{block['doc']}:{block['line']} ({block['lang']}{f', mpirun -np {np_}' if np_ else ''})"
        assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{block['code']}\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, f"{where}:\n{proc.stderr}"
        # An example trains what it shows: one that found an earlier block's finished run in its
        # --checkpoint-dir only evaluated (docs/elastic.md's --respawn and --spares, in the --join
        # example's folder), in a reader's folder as here. A block may run one command again on
        # purpose (docs/checkpoints.md: "the same command again continues"): once per repeat.
        commands = [ln.strip() for ln in block["code"].splitlines() if ln.strip() and not ln.strip().startswith("#")]
        assert proc.stdout.count("so nothing was trained") <= len(commands) - len(set(commands)), \
            f"{where} resumed from a finished run of an earlier block of its section: give it its own " \
            f"--checkpoint-dir\n{proc.stdout}"
        if block["least_accuracy"] is not None:
            got = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
            assert got and min(got) >= block["least_accuracy"], f"{where}: test accuracy {got}, " \
                f"the text promises at least {block['least_accuracy']}:\n{proc.stdout}"


def test_readme_figures_come_from_dated_results_files():
    """Each results file the README or a docs page cites exists and says when it was measured."""
    text = "".join((ROOT / doc).read_text() for doc in DOCS)
    cited = sorted(set(re.findall(r"\]\((benchmarks/[A-Z_]+\.md)\)", text)))
    assert len(cited) >= 5, cited
    for path in cited:
        content = (ROOT / path).read_text()
        assert re.search(r"20\d\d-[01]\d-[0-3]\d", content), f"{path} does not say when it was measured"


def test_the_flag_table_names_only_flags_that_exist_with_their_defaults():
    """The README's Main flags table against the parser (generated from TrainConfig): a renamed or
    removed flag, or a changed default of a one-flag row, fails here."""
    import dataclasses

    from mpitrain.cli import build_parser
    from mpitrain.core.config import TrainConfig
    from mpitrain.core.config_io import flag_name

    text = (ROOT / "docs" / "flags.md").read_text()
    table = text.split("## Main flags", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `--")]
    flags = {opt for a in build_parser()._actions for opt in a.option_strings}
    named = {f for row in rows for f in re.findall(r"(--[a-z][a-z0-9-]*)", row.split(" | ")[0])}
    assert named - flags == set(), f"the README names flags that do not exist: {named - flags}"
    assert len(named) >= 40, len(named)
    by_flag = {flag_name(f): f for f in dataclasses.fields(TrainConfig)}
    checked = 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        first = re.findall(r"(--[a-z][a-z0-9-]*)", cells[0])
        field = by_flag.get(first[0]) if len(first) == 1 else None
        if field is None or not isinstance(field.default, (int, float)) or isinstance(field.default, bool):
            continue
        assert cells[1] == f"{field.default:g}", f"{first[0]}: README says {cells[1]}, the code {field.default}"
        checked += 1
    assert checked >= 5, checked


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs make it for plain titles."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_front_page_leads_somewhere():
    """README.md is read on GitHub, not built by mkdocs (which checks docs/ with --strict): each of its
    relative links names a file or folder that exists, and a section of it that exists."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text)
    assert len(links) >= 15, links
    for path, anchor in links:
        if path.startswith(("http://", "https://")):
            continue
        target = ROOT / (path or "README.md")
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            headings = [ln.lstrip("#") for ln in target.read_text().splitlines() if ln.startswith("#")]
            assert anchor in {_anchor(h) for h in headings}, f"README links to {path}#{anchor}: no such section"
