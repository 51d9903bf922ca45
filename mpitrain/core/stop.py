"""What ends a training phase at its next step boundary: the user's stop request, or the job's own
request to end the phase for a change of members (making room for a joiner, a spare or a
replacement). The two are kept apart: a stop ends the job with 128 + its signal, and a second
signal forces the exit (stopping.FORCE_AFTER_S); making room ends only the phase, the job going on.

Each process has one (`STOP`): its signal handlers (membership/stopping.py) and every message
header it sends or reads (exchange/protocol.H_SIGNAL) reach it; the rest of the package reads it as
`ctx.stop`. On the wire: 0 nothing, a signal's number, UNKNOWN (a stop whose signal the sender does
not know) or ROOM (no stop: rank 0 makes room).
"""

from __future__ import annotations

import signal
import time

UNKNOWN = -1  # on the wire: a stop was requested, by a signal this sender does not know
ROOM = -2  # on the wire: no stop, but rank 0 ends this phase to let a worker in (membership/lobby.py)
# Origins that pass a stop on (StopRequest.origin): a peer's word, and the sync workers' sum of their votes
# (each vote is a worker's own stop request: its origin is the one to name).
HEARD = "heard from rank "
VOTED = "the workers' stop vote"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """This process's knowledge of a stop request (whether one was made, and by which signal), and
    of rank 0's request to end this phase for a change of members (`room`)."""

    def __init__(self):
        self.requested = False
        self.signum = 0  # the signal, once known (0: none, or not known here)
        self.since: float | None = None  # when it was first requested (time.monotonic)
        self.room = False  # the phase ends for a new member; the job goes on
        # What asked this process to stop, first: a signal it received, a peer's message, the sync workers'
        # vote. The summary names the rank it began at (duties/summary.stop_origin): a stop whose signal no
        # rank knows is reported as SIGTERM (exit 143), and without it nobody could tell where it came from.
        self.origin = ""

    @property
    def due(self) -> bool:
        """Whether this phase ends at the next step boundary (a stop, or room to make)."""
        return self.requested or self.room

    def request(self, signum: int = 0, origin: str = "") -> None:
        if not self.requested:
            self.since = time.monotonic()
            self.origin = origin or (f"{signal_name(signum)} received" if signum > 0 else "a stop request")
        self.requested = True
        if signum > 0 and not self.signum:
            self.signum = signum

    def make_room(self) -> None:
        self.room = True

    def room_made(self) -> None:
        """The new world is formed (or joined): its phase starts with no room to make. A stop stays."""
        self.room = False

    @property
    def wire(self) -> int:
        """What a message header says of it (protocol.H_SIGNAL): a stop outranks room to make."""
        if self.requested:
            return self.signum or UNKNOWN
        return ROOM if self.room else 0

    def heard(self, value: int, sender: int = -1) -> None:
        """Rank `sender`'s header said `value` (0: nothing)."""
        if value == ROOM:
            self.room = True
        elif value:
            self.request(max(int(value), 0), f"{HEARD}{sender}")

    def reset(self) -> None:
        self.requested, self.signum, self.since, self.room, self.origin = False, 0, None, False, ""


STOP = StopRequest()  # one per process: signal handlers and message headers both reach it
