"""say(): how every rank writes a line. The bottom of the package: it imports nothing of mpitrain."""

from __future__ import annotations

import os
import sys


def say(line: str, stream=None) -> None:
    """One line in one write: mpirun interleaves ranks' output at write boundaries. A reader that
    stopped reading (`python -m mpitrain | head`) does not end the run: it goes on to its end
    (checkpoint, goodbyes, exit code) with this stream sent to /dev/null, no traceback."""
    stream = stream or sys.stdout
    try:
        stream.write(line + "\n")
        stream.flush()
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # the exit's flush must not fail again
        except (OSError, ValueError):  # not a file descriptor's stream: nothing more to write to anyway
            pass
