"""Processes and MPI implementations: which MPI runs the job (mpiimpl.py: every fact that differs
between MPICH and Open MPI), each rank's supervisor under hydra, the reaper that ends a launcher
left waiting for a lost host, the lock on an output folder, and the `mpitrain launch` subcommand.
"""
