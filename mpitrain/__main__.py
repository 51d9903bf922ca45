import signal
import sys

from mpitrain.launch.mpiimpl import hydra_env

# Under hydra, before anything else: its SIGUSR1 ("a peer died") reaches every rank's process group, and a
# worker the job spawns is still importing when a death is told; its default would kill it, and hydra would
# then end the job (supervise.py ignores it from there on, mpiimpl.ignore_death_notices after MPI_Init).
# Not under srun, where SIGUSR1 is Slurm's warning of the time limit (stopping.py).
if hydra_env() and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

from mpitrain.cli import main  # noqa: E402  (after the signal's disposition)

sys.exit(main())
