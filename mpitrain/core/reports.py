"""What a rank reports to rank 0 at the end of a run: typed here, JSON bytes on the wire.

A worker sends a WorkerReport, a parameter server other than rank 0 (--num-ps) a ShardReport,
point to point (ending.send_report): never pickled; every rank runs the same mpitrain (agreed at
setup), so both ends know the fields.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from mpitrain.core.guard import Diverged

if TYPE_CHECKING:  # a type only: the core imports nothing outside it (pyproject.toml's contracts)
    from mpitrain.duties.checkpoint import TrainState



LOSS_WINDOW = 20  # final_loss: mean minibatch loss of the last LOSS_WINDOW global steps


@dataclass
class WorkerResult:
    """What a worker's training loop hands back, async or sync (and the single-process run's sync loop)."""

    pushed: int  # gradients computed and sent (sync: steps taken)
    params: np.ndarray  # host copy of the final parameters
    time: dict  # observe.Activity.times(): wall, compute and wait seconds
    dropped: int = 0  # gradients left out of every update (--quorum: late ones)
    contributed: int | None = None  # sync: gradients that went into updates
    recent_loss: float | None = None  # sync: mean minibatch loss of the last LOSS_WINDOW steps
    train_state: TrainState | None = None  # what a checkpoint of the final step holds (async: the last pull's)
    diverged: Diverged | None = None  # the non-finite or exploding loss that stopped the run, if any
    counted: int | None = None  # async: the gradients its pushes carried (--local-steps: inner steps; else `pushed`)


def mean_loss(recent: deque) -> float:
    """The mean of the last LOSS_WINDOW minibatch losses (a NaN placeholder left out)."""
    values = [v for v in recent if v == v]
    return float(np.mean(values)) if values else float("nan")


@dataclass
class WorkerReport:
    rank: int
    pushed: int  # gradients computed and sent (sync: steps taken)
    dropped: int  # gradients left out of every update (--quorum)
    diverged: dict | None  # the non-finite or exploding loss that stopped it, if any (guard.Diverged as a dict)
    contributed: int | None  # sync: gradients that went into updates
    test_loss: float  # of this worker's own parameters
    test_accuracy: float
    digest: str  # hash of its final parameters (equal on every worker in sync mode)
    time_breakdown: dict  # fractions of wall time: compute, communication_and_wait, other
    step_time: dict  # observe.Activity.report(): median step time and its spread
    max_rss_mb: list[float] | None = None  # [start, end] of training (a single-process run's own report: None)
    timeline: list[dict] = field(default_factory=list)  # --timeline spans
    stop_signal: int = 0  # the signal that asked this rank to stop, if it knows one (stopping.py)
    stop_origin: str = ""  # what asked it to stop first (core/stop.StopRequest.origin)
    bytes_moved: list[int] | None = None  # [sent, received] through MPI
    exchanges: int = 0  # what it sent its work in: async pushes, sync Allreduces (--local-steps: its outer steps)
    counted: int | None = None  # async: the gradients its pushes carried (gradients.WorkerResult.counted)

    role = "worker"


@dataclass
class ShardReport:
    """A parameter server's account of its shard (the summary's ps_shards entries)."""

    rank: int
    host: str
    shard: int
    params: int
    busy_fraction: float
    global_step: int
    bytes_in: int
    bytes_out: int
    staleness: dict
    diverged: dict | None
    timeline: list[dict] = field(default_factory=list)
    stop_signal: int = 0
    stop_origin: str = ""

    role = "shard"

    def entry(self) -> dict:
        """The summary's ps_shards entry (the spans go to the trace)."""
        out = asdict(self)
        del out["timeline"], out["stop_signal"], out["stop_origin"]
        return out


KINDS = {kind.role: kind for kind in (WorkerReport, ShardReport)}


def to_bytes(report: WorkerReport | ShardReport) -> bytes:
    return json.dumps({"role": report.role, **asdict(report)}).encode()


def from_bytes(data: bytes) -> WorkerReport | ShardReport:
    fields = json.loads(data)
    return KINDS[fields.pop("role")](**fields)


@dataclass
class Summary:
    """Rank 0's account of a run (summary.build_summary): printed, written by --summary-json,
    closed into the --log-dir log, and handed back by mpitrain.train(), each as `to_dict()`. The
    README's summary keys are these fields (a test keeps the two in step)."""

    mpitrain_version: str
    mode: str  # async, sync or local
    model: str
    model_description: str
    dataset: str
    world_size: int
    workers: int
    global_step: int
    worker_steps: list[int]  # per worker of worker_ranks: gradients rank 0 applied / that went into averaged updates
    gradients_pushed: list[int]
    wall_seconds: float  # training time
    samples_per_second: float | None  # this run only, when resumed; None when it trained nothing
    test_accuracy: float
    test_loss: float
    ema_test_loss: float | None  # --ema-decay
    ema_test_accuracy: float | None
    worker_ranks: list[int]  # the workers whose entries follow, in order
    worker_test_accuracy: list[float]
    final_loss: float | None  # mean minibatch loss of the last global steps (None: no step trained)
    lost_workers: list[dict]  # rank, global step, reason and worker steps of each worker declared lost
    joined_workers: list[dict]  # rank, global step and host of each worker that joined (--join; ranks are renumbered then)
    failovers: list[dict]  # each take-over of a lost rank 0 (--on-lost-server continue; failover.py)
    max_rss_mb: list[dict]  # per rank: peak resident memory at the start and end of training
    dropped_gradients: int
    dropped_gradients_per_worker: list[int]
    staleness: dict  # mean, p50, p99, max over applied gradients
    quorum: int | None  # sync: gradients averaged per update
    lr_scaling: str
    lr_effective: float  # after the warm-up, before --lr-decay
    steps_per_second: float | None
    eval_history: list[dict]
    param_digest: str  # hash of rank 0's final parameters
    worker_param_digests: list[str]
    time_breakdown: list[dict]  # per worker: fractions of wall time
    worker_step_seconds: list[dict]
    slow_workers: list[dict]
    ps_busy_fraction: float | None  # rank 0's CPU time / wall time
    num_ps: int
    ps_shards: list[dict]  # ShardReport.entry() per parameter server
    resumed_from: str | None
    checkpoints: list[str]  # written by this run, oldest first
    placement: list[str]  # each rank's start line
    config: dict  # every flag
    diverged: dict | None  # global step, ranks, loss and why of a non-finite or exploding loss
    stopped: dict | None  # stopped on request before the budget: signal, global step (stopping.py)
    trained: bool  # False when the checkpoint it resumed from had reached the budget: evaluated only
    write_errors: dict | None  # failed writes by kind (count, first), and the newest checkpoint written (outputs.py)
    worker_bytes: list[list[int] | None] = field(default_factory=list)  # per worker: [sent, received] through MPI
    bytes_per_sample: float | None = None  # every worker's sent + received bytes / samples trained
    # the workers' mean share of their wall time spent computing (time_breakdown's compute; None: one process)
    compute_utilisation: float | None = None
    worker_exchanges: list[int] = field(default_factory=list)  # per worker: WorkerReport.exchanges
    # Per epoch begun: samples applied, missed, repeated, dropped, and left out by the whole-batch rule (core/ledger.py)
    epochs: list[dict] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


SUMMARY_KEYS = tuple(f.name for f in fields(Summary))


@dataclasses.dataclass
class RoleResult:
    """What training in its role left on this rank: rank 0 (and a single-process run) its final state and
    evaluation; a worker its report; a server other than rank 0 its shard's report."""

    state: object = None  # server.ServerState: rank 0 and the single-process run
    test_loss: float = float("nan")  # rank 0: of its final parameters
    test_accuracy: float = float("nan")
    ema: tuple = (None, None)  # rank 0, --ema-decay: test loss and accuracy of the moving average
    worker: WorkerReport | None = None  # a worker's (and the single-process run's) report to rank 0
    shard: ShardReport | None = None  # a server's other than rank 0
    max_rss_mb: list[float] = dataclasses.field(default_factory=list)  # start and end of training
    held: object = None  # a worker: checkpoint.TrainState of its final step (a take-over after training starts from it)

    @property
    def report(self) -> WorkerReport | ShardReport | None:
        return self.worker or self.shard

    @property
    def checkpoints(self) -> list[str]:
        return self.state.checkpoints if self.state is not None else []


@dataclasses.dataclass
class Outcome:
    """How a run ended on this rank: the exit code, and what the Python API hands back."""

    code: int
    summary: dict | None = None  # rank 0
    report: dict | None = None  # a worker: its own report to rank 0
    error: str | None = None  # the one line, on every rank, when the code is not 0
    params: np.ndarray | None = None  # rank 0: the final flat parameters (host)
    model: object = None  # rank 0: their layout, on NumPy (model.Model), for the API's predict
    grown: tuple | None = None  # a worker joined: (the flags, the new world, its node) of the run's next phase
    # A peer was lost: MPI_Finalize would wait for it forever, so this process must end without it
    # (the command line does at once; the Python API when the interpreter exits: api.LostPeer).
    mpi_broken: bool = False
