"""Write a file so that readers only ever see the old version or the complete new one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(target: Path, write: Callable[[IO], None], binary: bool = False) -> Path:
    """`write(f)` into a temporary file beside `target`, fsync, then os.replace onto `target`.
    A crash (even SIGKILL) at any moment leaves `target` as it was, plus at most a `.*.tmp` file."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes it 0600: readable as a plain open() would be
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def set_aside(files: list[Path], directory: Path) -> Path | None:
    """Move `files` (in `directory`) into a new superseded-<time> subfolder, so that a new run
    neither prunes nor appends to an earlier run's outputs. Returns that folder, or None when there
    was nothing to move."""
    import time

    if not files:
        return None
    target = directory / time.strftime("superseded-%Y%m%d-%H%M%S")
    target.mkdir(exist_ok=True)
    for p in files:
        os.replace(p, target / p.name)
    return target
