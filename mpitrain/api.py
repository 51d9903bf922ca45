"""The Python API: `mpitrain.train(...)` and `mpitrain.evaluate(...)`, the command line without argv.

    import mpitrain
    summary = mpitrain.train(model="mlp", dataset="digits", epochs=5)

Options are the command line's flags with underscores (`batch_size=100`, `checkpoint_dir="ck"`),
with the same defaults and checks (config.py); a bad one raises UsageError before MPI is touched.
It runs in one process, or on every rank of an `mpirun` (each rank calls train() with the same
options): rank 0 gets the run's summary (the --summary-json dict), a worker its own report. The
process keeps MPI between calls, so one script can run a sweep.
"""

from __future__ import annotations

import dataclasses

from mpitrain.config import TrainConfig, UsageError, parse_straggler, validate


class Diverged(RuntimeError):
    """Training stopped on a non-finite or exploding loss (the command line's exit 4). `summary`
    is the run's summary on rank 0 (its `diverged` entry says where), None on a worker."""

    def __init__(self, line: str, summary: dict | None):
        super().__init__(line)
        self.summary = summary


class TrainingFailed(RuntimeError):
    """Any other non-zero end (e.g. every worker lost): `code` is the command line's exit code."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def config(**options) -> TrainConfig:
    """A validated TrainConfig from keyword options (the flags, with underscores)."""
    unknown = sorted(set(options) - FIELDS)
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are the command line's flags with "
                         f"underscores (python -m mpitrain --help), e.g. batch_size=100")
    if isinstance(options.get("hidden"), (int, str)):  # hidden=100 or hidden="256,128", as the flag
        hidden = options["hidden"]
        try:
            options["hidden"] = (hidden,) if isinstance(hidden, int) else tuple(int(h) for h in hidden.split(","))
        except ValueError:
            raise UsageError(f"hidden takes widths like 100 or '256,128', not {hidden!r}") from None
    elif "hidden" in options:
        options["hidden"] = tuple(options["hidden"])
    if "stragglers" in options:  # ["2:x5", "3:0.01"], as --straggler
        options["stragglers"] = tuple(s if isinstance(s, tuple) else parse_straggler(s) for s in options["stragglers"])
    return validate(TrainConfig(**options))


def rank() -> int:
    """This process's rank in COMM_WORLD (0: the parameter server, which gets the summary)."""
    from mpitrain.runtime import world

    return world().Get_rank()


def train(**options) -> dict:
    """Train; return the summary (rank 0) or this worker's report. Raises UsageError for bad
    options or data (on every rank), Diverged when the loss diverged, TrainingFailed otherwise."""
    from mpitrain.runtime import node_info, world
    from mpitrain.trainer import EXIT_DIVERGED, run

    cfg = config(**options)
    comm = world()
    outcome = run(cfg, comm, node_info(comm), None, library=True)
    if outcome.code == 2:
        raise UsageError(outcome.error.removeprefix("mpitrain: error: "))
    if outcome.code == EXIT_DIVERGED:
        raise Diverged(outcome.error, outcome.summary)
    if outcome.code != 0:
        raise TrainingFailed(outcome.error or f"mpitrain: exit {outcome.code}", outcome.code)
    return outcome.summary if outcome.summary is not None else outcome.report


def evaluate(checkpoint: str, dataset: str = "digits", data_dir: str | None = None) -> dict:
    """Test accuracy, loss and confusion matrix of a checkpoint, in this process (no MPI)."""
    from mpitrain.evaluation import evaluate as evaluate_checkpoint

    return evaluate_checkpoint(checkpoint, dataset, data_dir)
