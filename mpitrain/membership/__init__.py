"""Who is in the job now: heartbeats and the watch that reads them (liveness), losses, regroups
(elastic), joins, respawns, spares, rank 0's take-over (failover), a rank stuck inside MPI, the stop
request (Ctrl-C, SIGTERM, Slurm's warning). (The fault tests' injection hooks are launch/faults.py.)
"""
