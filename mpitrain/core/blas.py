"""One BLAS thread per rank, for the command line and the Python API alike.

At these matrix sizes two BLAS threads are slower than one, and ranks already share the cores: 3
ranks on 2 cores with OpenBLAS's default of a thread per core ran the API 6-14x slower than the CLI
(issue 77). OpenBLAS reads its variable when NumPy loads, so the command line pins it before NumPy
loads; a script has often loaded NumPy before it calls `mpitrain.train`, so there the loaded BLAS is
limited at run time too (threadpoolctl). An explicit setting of any of the variables wins.
"""

from __future__ import annotations

import os
import sys

BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pin_blas_threads() -> None:
    if any(os.environ.get(var) for var in BLAS_THREAD_VARS):
        return
    for var in BLAS_THREAD_VARS:  # before NumPy loads, and for every process this one starts
        os.environ[var] = "1"
    if "numpy" in sys.modules:  # already loaded with a thread per core: limit it where it runs
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")
