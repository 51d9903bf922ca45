"""say(): how every rank writes a line. The bottom of the package: it imports nothing of mpitrain."""

from __future__ import annotations

import sys


def say(line: str, stream=None) -> None:
    """One line in one write: mpirun interleaves ranks' output at write boundaries."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()
