"""The launcher layer (mpitrain/launch/mpiimpl.py): which MPI runs a process, and what follows from it.
The behaviour of each implementation is tested end to end by the rest of the suite, which CI runs
under both; these are the answers themselves."""

import subprocess
import sys

from mpitrain.launch import mpiimpl
from mpitrain.launch.mpiimpl import MPICH, OPENMPI


def test_the_implementation_is_told_by_the_library_and_a_rank_by_the_environment():
    assert mpiimpl.hydra_env({"PMI_RANK": "1", "PMI_FD": "7", "MPI_LOCALRANKID": "1"})
    assert not mpiimpl.hydra_env({"PMI_RANK": "1", "PMI_FD": "7"})  # srun --mpi=pmi2: no hydra
    assert mpiimpl.from_library("MPICH Version:      5.0.2\nMPICH Release date: ...") is MPICH
    assert mpiimpl.from_library("Open MPI v5.0.11, package: Open MPI user@localhost ...") is OPENMPI
    assert mpiimpl.launcher_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2 and mpiimpl.launcher_rank({}) is None
    assert mpiimpl.launcher_local_rank({"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"}) == 1


def test_what_each_needs_differs_where_it_was_measured_to():
    assert MPICH.keep_going == ("-disable-auto-cleanup",) and OPENMPI.keep_going == ("--with-ft", "ulfm")
    assert (MPICH.slurm_mpi, OPENMPI.slurm_mpi) == ("pmi2", "pmix")
    assert MPICH.hostfile_line("n1", 3) == "n1:3" and OPENMPI.hostfile_line("n1", 3) == "n1 slots=3"
    assert "--oversubscribe" in mpiimpl.local_flags(OPENMPI) and mpiimpl.local_flags(MPICH) == []
    assert mpiimpl.local_env(MPICH) == {} and "OMPI_MCA_btl" in mpiimpl.local_env(OPENMPI)


def test_only_ulfm_makes_a_rank_wait_for_the_others_before_a_non_zero_exit():
    assert mpiimpl.ends_job_on_error_exit({mpiimpl.ULFM_VAR: "1"})
    assert not mpiimpl.ends_job_on_error_exit({})  # hydra, srun: farewell returns at once
    assert mpiimpl.farewell(None, 30.0, env={}) is True


def test_the_job_scripts_ask_which_srun_plugin(mpi):
    out = subprocess.run([sys.executable, "-m", "mpitrain.launch.mpiimpl", "slurm-mpi"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == mpi.slurm_mpi  # this install's MPI (mpi4py's library)


def test_a_killed_launchers_session_folder_is_swept_and_a_live_ones_is_not(tmp_path):
    """Open MPI's prterun leaves /tmp/ompi.<pid> (its PMIx socket inside) when killed; a later
    prterun with the same pid cannot listen there. Only folders of launchers that are gone go."""
    import os

    from mpitrain.launch import mpiimpl

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for name in (f"ompi.{dead}", f"ompi.{os.getpid()}", "ompi.x1", f"other.{dead}"):
        (tmp_path / name / "1").mkdir(parents=True)
    (tmp_path / f"ompi.{dead}" / "pmix.vm.tool").write_text("")
    assert mpiimpl.sweep_sessions(mpiimpl.OPENMPI, str(tmp_path)) == [str(tmp_path / f"ompi.{dead}")]
    assert sorted(os.listdir(tmp_path)) == sorted([f"ompi.{os.getpid()}", "ompi.x1", f"other.{dead}"])
    assert mpiimpl.sweep_sessions(mpiimpl.MPICH, str(tmp_path)) == []  # hydra leaves no such folder
