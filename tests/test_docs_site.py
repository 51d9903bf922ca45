"""The documentation site builds with no warning, and a broken link fails the build.

`mkdocs build --strict` fails on any warning; mkdocs.yml's `validation` makes every kind of broken
link one (a missing page or file, a missing anchor, a link to a folder). The check CI once ran
could not fail (`--quiet` dropped the warnings before `--strict` counted them): each case below
breaks a copy of the site and asserts that the same command fails, naming the link.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import only_on

ROOT = Path(__file__).resolve().parent.parent
BESIDE_DOCS = ("benchmarks", "examples", "hostfiles", "jobs", "README.md")  # docs/ links to them; the README is included
NOT_MPI = "the documentation site, the same under either MPI"


def build(root: Path) -> subprocess.CompletedProcess:
    """CI's command, exactly: `mkdocs build --strict` (never --quiet) in the site's folder."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(root / "_site")],
                          cwd=root, capture_output=True, text=True, timeout=300)


def copy_of_site(tmp: Path) -> Path:
    shutil.copy(ROOT / "mkdocs.yml", tmp / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp / "docs", symlinks=True)
    for name in BESIDE_DOCS:
        (tmp / name).symlink_to(ROOT / name)
    return tmp


@only_on("mpich", NOT_MPI)
def test_the_site_builds_with_no_warning(tmp_path):
    proc = build(copy_of_site(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr


@only_on("mpich", NOT_MPI)
@pytest.mark.parametrize("link,named", [
    ("[shm](modes.md#no-such-section)", "does not contain an anchor '#no-such-section'"),
    ("[here](#nowhere-on-this-page)", "no such anchor"),
    ("[gone](no-such-page.md)", "no-such-page.md"),
    ("[folder](hostfiles/)", "unrecognized relative link 'hostfiles/'"),
])
def test_a_broken_link_fails_the_build(tmp_path, link, named):
    site = copy_of_site(tmp_path)
    page = site / "docs" / "flags.md"
    page.write_text(page.read_text() + f"\nSee {link}.\n")
    proc = build(site)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr  # mkdocs logs to stderr, and says it aborted on stdout
    assert "Aborted with 1 warnings in strict mode" in said, said[-2000:]
    assert named in said


def test_no_page_is_left_out_of_the_site():
    """A link to a page in `exclude_docs` is only INFO in mkdocs 1.6, whatever `validation` says: a
    404 on the built site that --strict never sees (benchmarks/README.md was one)."""
    assert "exclude_docs" not in (ROOT / "mkdocs.yml").read_text()


MAX_PAGE_WORDS = 2500  # a page read in one sitting; more is split by what it is about (issue 77)
README_LINES = 250


def test_every_page_is_short_enough_to_read_in_one_sitting():
    pages = {p.name: len(p.read_text().split()) for p in (ROOT / "docs").glob("*.md")}
    assert not {n: w for n, w in pages.items() if w > MAX_PAGE_WORDS}, sorted(pages.items(), key=lambda x: -x[1])[:3]
    rows = [(p.name, len(ln)) for p in (ROOT / "docs").glob("*.md") for ln in p.read_text().splitlines()
            if ln.startswith("|")]
    assert max(n for _, n in rows) <= 1500, max(rows, key=lambda r: r[1])  # a table row is read, not scrolled


def test_the_front_page_is_a_newcomers_and_holds_no_history():
    """Under README_LINES lines; no dated history ("until 2026-11-29", "since ..."): results files
    keep that. A date may appear in a link's target (a results file's dated section), not in the text."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < README_LINES
    words = re.sub(r"\]\([^)]*\)", "]", text)  # link targets out
    assert not re.findall(r"20\d\d-[01]\d-[0-3]\d", words), re.findall(r".{40}20\d\d-[01]\d-[0-3]\d.{10}", words)
