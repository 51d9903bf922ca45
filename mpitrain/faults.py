"""Fault injection for the fault tests (tests/test_faults.py), read from the environment:

MPITRAIN_INJECT_NAN=RANK:STEP   worker RANK reports a NaN loss at its local step STEP
MPITRAIN_INJECT_KILL=RANK:STEP  worker RANK SIGKILLs itself at its local step STEP (as the OOM
                                killer or `kill -9` would)
"""

from __future__ import annotations

import os
import signal


def injected_step(var: str, rank: int, env=os.environ) -> int | None:
    """STEP when `var` is RANK:STEP for this rank, else None."""
    who, _, step = env.get(var, "").partition(":")
    return int(step) if who.isdigit() and int(who) == rank and step.isdigit() else None


class Kill:
    """MPITRAIN_INJECT_KILL for this rank: `at(local_step)` kills the process at the step."""

    def __init__(self, rank: int):
        self.step = injected_step("MPITRAIN_INJECT_KILL", rank)

    def at(self, local_step: int) -> None:
        if local_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
