"""Writes that must never end a run: checkpoints, the --log-dir log, the timeline, the summary.

A full disk, a quota, an I/O error, a read-only remount or a folder removed under a running job
makes a write fail with an OSError. Training outlives it: the first failure of each kind prints
one line naming the path, the error and what happens now; later ones are counted; the summary's
`write_errors` reports them all, with the newest checkpoint that was written. A run whose final
checkpoint or summary could not be written ends with ExitCode.OUTPUTS_INCOMPLETE, and its summary
goes to standard output so that the result is never lost.
"""

from __future__ import annotations

import sys


class WriteErrors:
    """This run's failed writes, by kind (checkpoint, log, tensorboard, timeline, summary)."""

    def __init__(self):
        self.kinds: dict[str, dict] = {}
        self.newest_checkpoint: str | None = None  # the newest one this run wrote, or resumed from
        self.incomplete = False  # the final checkpoint or the summary is missing

    def failed(self, kind: str, what: str, path, error: OSError, then: str = "training goes on") -> None:
        why = error.strerror or type(error).__name__
        self.note(kind, f"{what} not written: {why} ({path})", then)

    def note(self, kind: str, first: str, then: str) -> None:
        """Count one event of `kind`; the first one is said in one line."""
        entry = self.kinds.setdefault(kind, {"count": 0, "first": None})
        entry["count"] += 1
        if entry["count"] > 1:
            return
        entry["first"] = first
        # One write of one line (metrics.say's rule; metrics imports this module, so not say itself).
        sys.stderr.write(f"mpitrain: {first}; {then} (later ones are counted in the summary's write_errors)\n")
        sys.stderr.flush()

    def report(self) -> dict | None:
        if not self.kinds:
            return None
        return {**{k: dict(v) for k, v in self.kinds.items()}, "newest_checkpoint": self.newest_checkpoint}


WRITES = WriteErrors()  # one per run (trainer.run makes a new one): every writer on rank 0 reports here


def reset() -> None:
    WRITES.__init__()  # in place: every module holds this one object
