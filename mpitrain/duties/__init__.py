"""Rank 0's duties, driven by the global step: the run's state (chief.py), evaluation, checkpoints,
the bar, the log and the summary, metrics, the timeline, and the `evaluate` and `plot` subcommands
that read what these wrote.
"""
