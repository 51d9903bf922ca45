"""What the launcher's environment says about this process, without MPI (so --version, the API's
local_rank() and the supervisor can ask before, or instead of, MPI_Init). Each launcher names its
variables differently: MPICH's hydra (PMI_*, MPI_LOCALRANKID), Open MPI (OMPI_COMM_WORLD_*), PMIx,
and Slurm's srun (SLURM_*)."""

from __future__ import annotations

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _first_int(env, names: tuple[str, ...]) -> int | None:
    for var in names:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def launcher_rank(env) -> int | None:
    """This process's rank as the launcher's environment tells it, or None (not launched)."""
    return _first_int(env, RANK_VARS)


def launcher_local_rank(env) -> int | None:
    """This process's rank among those on its host, as the launcher tells it, or None."""
    return _first_int(env, LOCAL_RANK_VARS)
