"""`mpitrain run SCRIPT [ARGS...]`: a Python script that calls `mpitrain.train()`, run as each rank
under the supervisor the command line has.

    mpirun -disable-auto-cleanup -np 3 mpitrain run train.py --lr 0.1

Under MPICH's hydra a rank killed by a signal takes the whole job down unless a process stands
between hydra and the rank (supervise.py). `python -m mpitrain` has one; `python train.py` does not,
so there a SIGKILLed worker ended the job and the script's next line never ran (issue 82). Here the
script runs as `python train.py ARGS` would (its own `__main__`, `sys.argv`, its folder first on
`sys.path`), in the supervised rank, with one BLAS thread per rank: a lost worker reaches it as
`mpitrain.LostPeer` on every survivor. Under Open MPI and srun there is no supervisor to add.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpitrain.core.blas import pin_blas_threads
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.launch.supervise import supervise

USAGE = "usage: mpitrain run SCRIPT [ARGS...]  (e.g. mpirun -disable-auto-cleanup -np 3 mpitrain run train.py)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        say(USAGE + "\n" + __doc__.split("\n\n")[2].replace("\n", " "), sys.stdout if argv else sys.stderr)
        return 0 if argv else ExitCode.USAGE
    script = argv[0]
    if not os.path.isfile(script):
        say(f"mpitrain run: error: {script} is not a file; give the path of your Python script "
            f"({USAGE.removeprefix('usage: ')})", sys.stderr)
        return ExitCode.USAGE
    pin_blas_threads()
    supervise()  # under hydra: the rest runs in the supervised rank; the supervisor never returns
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0
