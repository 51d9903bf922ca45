"""A rank whose MPI_Init never returns ends, in one line, --worker-timeout + 30 s after it started.

Where no supervisor stands above the rank (Open MPI, srun; hydra's ranks have one: supervise.py),
a rank lost before or inside MPI_Init leaves the others in it for good (measured under Open MPI's
ULFM, issue 82), holding Python's lock, so no thread of theirs can act.
"""

from __future__ import annotations

import os
import sys
from typing import Callable


def guard_mpi_init(bound_s: float) -> Callable[[], None]:
    """Where no supervisor stands above the rank (Open MPI, srun): a rank lost before or inside
    MPI_Init leaves the others in it for good (measured under Open MPI's ULFM, issue 82), holding the
    GIL, so no thread of theirs can act. faulthandler's timer, a C thread, ends this rank with exit 1
    when MPI_Init has not returned within `bound_s` (--worker-timeout + 30 s; an exit, not a signal:
    prterun reports ranks killed by a signal as a success). Its dump goes to a watcher process forked
    here, which says the one line instead. Returns what to call once MPI_Init has returned."""
    if not sys.platform.startswith("linux") or bound_s <= 0:
        return lambda: None
    import faulthandler

    from mpitrain.launch.mpiimpl import launcher_rank

    line = (f"mpitrain: rank {launcher_rank(os.environ)}: MPI_Init has not returned for {bound_s:g} s (--worker-timeout "
            f"+ 30 s): a rank was lost while the job started; ending (the same command starts the job again)\n").encode()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the watcher, a grandchild (no zombie of it stays beside the rank); made ready above,
        try:         # as a fork beside other threads must be
            if os.fork() == 0:
                os.close(w)
                said = os.read(r, 64)  # OK: MPI_Init returned; EOF: the rank is gone; else faulthandler's dump
                if said and said != INIT_RETURNED:
                    os.write(2, line)
        finally:
            os._exit(0)
    os.close(r)
    os.waitpid(middle, 0)
    to_watcher = os.fdopen(w, "wb", buffering=0)
    faulthandler.dump_traceback_later(bound_s, exit=True, file=to_watcher)

    def done() -> None:
        faulthandler.cancel_dump_traceback_later()
        to_watcher.write(INIT_RETURNED)
        to_watcher.close()

    return done


INIT_RETURNED = b"OK"
