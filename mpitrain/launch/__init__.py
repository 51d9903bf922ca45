"""Processes and MPI implementations: which MPI runs the job (mpiimpl.py: every fact that differs
between MPICH and Open MPI), each rank's supervisor under hydra, the reaper that ends a launcher
left waiting for a lost host, the lock on an output folder, the `mpitrain launch` subcommand, and the
fault tests' hooks (faults.py).
"""
