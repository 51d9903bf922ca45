import sys

from mpitrain.launch.mpiimpl import ignore_death_notices

# Before anything else, under hydra only: its SIGUSR1 ("a peer died") reaches every rank's process group, and a
# worker the job spawns is still importing when a death is told; its default would kill it, and hydra would
# then end the job. Not under srun, where SIGUSR1 is Slurm's warning of the time limit (stopping.py).
ignore_death_notices()

from mpitrain.cli import main  # noqa: E402  (after the signal's disposition)

sys.exit(main())
