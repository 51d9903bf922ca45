"""Every exit code mpitrain ends with, in one place (docs/checkpoints.md's "When things go wrong" table
says what each means to a user; a scheduler reads them)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # an unexpected exception during training: the job is aborted (MPI_Abort)
    USAGE = 2  # bad input (flags, data, hostfile, checkpoint): one line, every rank, before training
    PROTOCOL = 3  # a malformed message (magic, version, kind, count): MPI_Abort
    DIVERGED = 4  # every rank, after the summary: a non-finite or exploding loss stopped training
    PEER_LOST = 5  # a rank this one cannot go on without was lost (--worker-timeout)
    OUTPUTS_INCOMPLETE = 6  # training finished, but the final checkpoint or the summary was not written
    # Rank 0: the budget was finished by the workers left after one was lost (the summary lists it), or
    # after rank 0 itself was lost and a worker took over (--on-lost-server continue: failovers).
    # Not 0, so that a scheduler sees it: Open MPI's mpirun under ULFM reports a run whose ranks all
    # exit 0 as a success even though a rank was killed (measured, Open MPI 5.0.11). MPICH's mpirun
    # ORs every rank's exit status (measured: 4 and 1 give 5), so a killed worker's supervisor exits 0
    # (launch/supervise.py, killed_exit) and the job's code is this one there too.
    WORKER_LOST = 8


def interrupted(signum: int) -> int:
    """The shell's and Slurm's convention for "ended by signal N", so a scheduler reads it as
    interrupted: 130 (SIGINT), 143 (SIGTERM), 138 (SIGUSR1)."""
    return 128 + signum
