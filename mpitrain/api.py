"""The Python API: `mpitrain.train(...)` and `mpitrain.evaluate(...)`, the command line without argv.

    import mpitrain
    result = mpitrain.train(model="mlp", dataset="digits", epochs=5)
    result["test_accuracy"], result.predict(mpitrain.dataset("digits").x_test[:5])

Options are the command line's flags with underscores (`batch_size=100`, `checkpoint_dir="ck"`);
`train`'s signature, defaults and docstring are generated from config.TrainConfig, so they are the
flags' own. A bad option, or one of the wrong type, raises UsageError before MPI is touched. It runs
in one process, or on every rank of an `mpirun` (each rank calls train() with the same options):
rank 0 gets the run's summary (the --summary-json dict) with the final parameters, a worker its
own report. The process keeps MPI between calls, so one script can run a sweep.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
import os
import re

import numpy as np

from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.config_checks import validate
from mpitrain.core.config_io import flag_name, parse_straggler
from mpitrain.core.model import Model  # public: the protocol a model of your own implements

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

# What each annotation accepts from Python, and how a refusal names it. bool is an int in
# Python: refused where a number is meant (epochs=True is a mistake, not one epoch).
# NumPy's scalars count (a sweep over np.linspace or np.arange hands them in).
KINDS = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
         "str": ((str,), "a string"), "bool": ((bool, np.bool_), "True or False")}


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


class LostPeer(TrainingFailed):
    """A rank of the job was lost (killed, or silent past --worker-timeout): the command line's
    exit 5 (this rank cannot go on) or 8 (rank 0 finished the budget without it). `result` is what
    train() would have returned -- rank 0's summary (its `lost_workers` say who and when) with the
    trained model, or this worker's report -- or None where none was made.

    MPI in this process can no longer be used: MPI_Finalize would wait for the dead rank forever,
    and the next train() would need it. So the interpreter goes on (run code after the loss: save,
    plot, report), and when it exits it leaves without MPI_Finalize, with `code` as its exit status
    whatever the script returns. A second train() needs a new process."""

    def __init__(self, line: str, code: int, result: "Result | None"):
        super().__init__(line, code)
        self.result = result


# How long a survivor of a lost peer waits at its exit for the others' code after LostPeer (_leave):
# the time that code may take on the slowest one, where the launcher would cut it short.
LEAVING_TOGETHER_S = 30.0
AFTER_A_LOSS = ("; MPI in this process can no longer be used (MPI_Finalize would wait for the lost rank): "
                "a second train() needs a new process, and this one exits with code {code} without MPI_Finalize")


class Result(dict):
    """What train() returns: the summary (rank 0) or this worker's report, as a dict, and on rank 0
    the trained model: `params` (the final flat float32 parameters), `model` (its layout, on NumPy)
    and `predict(x)`. A worker's are None."""

    def __init__(self, values: dict, params=None, model=None):
        super().__init__(values)
        self.params, self.model = params, model

    def predict(self, x):
        """Class indices for the rows of `x`, features as the dataset's loader gives them
        (mpitrain.dataset(NAME).x_test, for instance)."""
        if self.params is None or self.model is None:
            raise RuntimeError("this rank holds no trained parameters (train() ended without a model)")
        x = np.asarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.model.sizes[0]:
            raise ValueError(f"predict takes rows of {self.model.sizes[0]} features, not an array of shape {x.shape}")
        _, _, pred = self.model.evaluate(self.params, x, np.zeros(len(x), np.int64))
        return pred


def _suggest(name: str) -> str:
    """The option a mistyped or command-line-shaped keyword most likely meant."""
    if name.startswith("no_") and name[3:] in FIELDS:  # --no-progress -> progress=False
        return f"; use {name[3:]}=False"
    flags = {f.metadata["option"].flag: f.name for f in FIELDS.values() if f.metadata["option"].flag}
    if "--" + name.replace("_", "-") in flags:  # --straggler -> stragglers=[...]
        return f"; use {flags['--' + name.replace('_', '-')]}=[...] (the flag is repeatable)"
    close = difflib.get_close_matches(name, list(FIELDS), n=1)
    return f"; did you mean {close[0]}=?" if close else ""


def _check_type(name: str, value):
    """`value` as TrainConfig's field `name` holds it, or UsageError naming the type it takes."""
    f = FIELDS[name]
    kind = f.type.removesuffix(" | None")
    if value is None and f.type.endswith(" | None"):
        return None
    if name == "model" and not isinstance(value, str):  # a Model of your own (model.Model)
        from mpitrain.core.model import MODEL_MEMBERS

        missing = [m for m in MODEL_MEMBERS if not hasattr(value, m)]
        if missing:
            raise UsageError(f"model takes 'softmax', 'mlp' or an object with model.Model's members; "
                             f"{type(value).__name__} lacks {', '.join(missing)} (see examples/custom_model.py)")
        return value
    if name == "hidden":  # hidden=100, hidden="256,128" (as the flag) or hidden=(256, 128)
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        try:
            widths = tuple(int(h) for h in (value.split(",") if isinstance(value, str) else value))
            if any(isinstance(h, (bool, float)) for h in ([] if isinstance(value, str) else value)):
                raise ValueError
            return widths
        except (TypeError, ValueError):
            raise UsageError(f"hidden takes widths like 100, '256,128' or (256, 128), not {value!r}") from None
    if name == "stragglers":  # ["2:x5", "3:0.01"], as --straggler
        if isinstance(value, str):
            value = [value]
        try:
            return tuple(s if isinstance(s, tuple) else parse_straggler(s) for s in value)
        except (TypeError, AttributeError):
            raise UsageError(f"stragglers takes a list like ['2:x5', '3:0.01'], not {value!r}") from None
    if name == "staleness_lr" and isinstance(value, bool):  # the switch it was before it took a K
        return 1.0 if value else 0.0
    types, words = KINDS[kind]
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, types):
        example = f.default if f.default not in (None, ()) else {"int": 10, "float": 0.5, "str": "'...'"}[kind]
        raise UsageError(f"{name} takes {words}{' or None' if f.type.endswith(' | None') else ''}, "
                         f"not {value!r}; e.g. {name}={example!r}")
    return {"float": float, "int": int, "bool": bool}.get(kind, str)(value)


def config(**options) -> TrainConfig:
    """A validated TrainConfig from keyword options (the flags, with underscores)."""
    for name in sorted(options):
        if name not in FIELDS:
            raise UsageError(f"unknown option {name}{_suggest(name)} (the options are the command line's flags with "
                             f"underscores: help(mpitrain.train))")
    try:
        return validate(TrainConfig(**{name: _check_type(name, value) for name, value in options.items()}))
    except UsageError as e:
        raise UsageError(in_keywords(str(e))) from None


# The checks speak the command line's language (config_checks.validate); a caller of train() passed keywords.
_EXAMPLE = re.compile(r"(e\.g\.|as in) --([a-z][a-z0-9-]*) ([^\s;,)]+)")
_FLAG = re.compile(r"--(no-)?([a-z][a-z0-9-]*)")


def in_keywords(line: str) -> str:
    """A usage line with each of mpitrain's flags as its keyword: "e.g. --batch-size 100" ->
    "e.g. batch_size=100" (and "as in ..."), "--no-overlap" -> "overlap=False", "--lr" -> "lr".
    Other flags (mpirun's) stay."""
    by_flag = {flag_name(f): name for name, f in FIELDS.items()}

    def example(m):
        name = by_flag.get("--" + m[2])
        if name is None:
            return m[0]
        value = m[3]
        try:
            float(value)
        except ValueError:
            value = repr(value)
        return f"{m[1]} {name}={value}"

    def flag(m):
        name = by_flag.get("--" + m[2])
        if name is None:
            return m[0]
        return f"{name}=False" if m[1] else name

    return _FLAG.sub(flag, _EXAMPLE.sub(example, line))


def rank() -> int:
    """This process's rank in COMM_WORLD (0: the parameter server, which gets the summary)."""
    from mpitrain.node import world

    return world().Get_rank()


def size() -> int:
    """The number of processes in the job (1 in a plain `python`; parameter servers + workers under mpirun)."""
    from mpitrain.node import world

    return world().Get_size()


def local_rank() -> int:
    """This process's rank among those on its host, as the launcher says (MPICH's MPI_LOCALRANKID,
    Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID); 0 when no launcher started it.
    Asks no other rank, so it may be called from any one of them."""
    from mpitrain.launch.mpiimpl import launcher_local_rank

    node_rank = launcher_local_rank(os.environ)
    return node_rank if node_rank is not None else 0


def train(**options) -> Result:
    from mpitrain.core.blas import pin_blas_threads
    from mpitrain.core.exitcodes import ExitCode
    from mpitrain.node import node_info, world

    pin_blas_threads()  # as the command line does (core/blas.py)
    cfg = config(**options)
    comm = world(cfg)
    from mpitrain.trainer import run  # imports mpi4py.MPI, which initialises MPI: after world()
    outcome = run(cfg, comm, node_info(comm), None, library=True)
    if outcome.code == ExitCode.USAGE:  # not printed: the exception is the one place it is said
        raise UsageError(in_keywords(outcome.error.removeprefix("mpitrain: error: ")))
    result = Result(outcome.summary if outcome.summary is not None else outcome.report, outcome.params, outcome.model)
    if outcome.mpi_broken:
        _leave_at_exit(outcome.code)
        line = (outcome.error or "mpitrain: the job lost a rank (rank 0's summary says which)") + AFTER_A_LOSS.format(
            code=outcome.code)
        raise LostPeer(line, outcome.code, result if (outcome.summary or outcome.report) else None)
    if outcome.code == ExitCode.DIVERGED:
        raise Diverged(outcome.error, outcome.summary)
    if outcome.code != 0:
        raise TrainingFailed(outcome.error or f"mpitrain: exit {outcome.code}", outcome.code)
    return result


def _leave_at_exit(code: int) -> None:
    """When the interpreter exits, end the process without MPI_Finalize, which would wait for the
    lost rank forever (mpi4py calls it at exit; atexit runs this first, registered later)."""
    import atexit

    atexit.register(_leave, code)


def _leave(code: int) -> None:
    """Where the launcher ends every rank once half of them are gone (prterun under ULFM:
    mpiimpl.ends_job_on_error_exit), a survivor still running the caller's code after LostPeer was
    cut short by another's exit (measured: rank 1's print lost when rank 0 left second of 3): each
    survivor waits here, bounded, until every other one is at its exit too."""
    from mpitrain.launch import mpiimpl
    from mpitrain.launch.lock import exit_without_finalize
    from mpitrain.node import world

    mpiimpl.farewell(world(), LEAVING_TOGETHER_S)
    exit_without_finalize(code)


def _signature() -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                annotation=f.type) for f in FIELDS.values()],
                             return_annotation="Result")


def _options_doc() -> str:
    lines = []
    for f in FIELDS.values():
        opt = f.metadata["option"]
        words = opt.default_words(f.default)
        choices = opt.choice_list()
        lines.append(f"    {f.name}: {opt.help}" + (f" ({' | '.join(choices)})" if choices else "")
                     + (f"; default {words}" if words else ""))
    return "\n".join(lines)


train.__signature__ = _signature()
train.__doc__ = f"""Train; return the summary with the trained model (rank 0), or this worker's report.

Every rank of an mpirun calls it with the same options; in one process it trains locally. The
result is a dict (the --summary-json keys: test_accuracy, global_step, ...) with `params`, `model`
and `predict(x)` on rank 0. Raises UsageError for a bad option (name, type or value) before any MPI
traffic, and for bad data on every rank; Diverged when the loss diverged; LostPeer when a rank was
lost (the process lives on, MPI does not: see LostPeer); TrainingFailed otherwise.

Options (the command line's flags, with underscores; python -m mpitrain --help):
{_options_doc()}
"""


def evaluate(checkpoint: str, dataset: str | None = None, data_dir: str | None = None, model=None) -> dict:
    """Test accuracy, loss and confusion matrix of a checkpoint (a ckpt-*.npz file, or a
    --checkpoint-dir: its newest), in this process (no MPI), on `dataset` (default: the one it was
    trained on). A checkpoint of a model of your own
    needs that model (`model=MyModel(...)`, with the spec it was trained with)."""
    from mpitrain.duties.evaluation import evaluate as evaluate_checkpoint

    return evaluate_checkpoint(checkpoint, dataset, data_dir, model)


def dataset(name: str = "digits", data_dir: str | None = None):
    """The arrays a run trains on (x_train, y_train, x_test, y_test, n_classes), as --dataset NAME
    loads them: what predict() takes."""
    from mpitrain.core.data import load_dataset

    return load_dataset(config(dataset=name, data_dir=data_dir))
