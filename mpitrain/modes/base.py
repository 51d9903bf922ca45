"""What a mode is: one object with the same small interface, whatever it trains with.

A mode says which loop each rank runs (`run`, one signature for every role) and the policies
the rest of the job asks of it: what a global step is (the budget), the examples behind one (the
global batch), whether the workers left regroup after a loss, what a worker's count means in the
summary, and what rank 0 waits for while it waits. modes/__init__.py picks the object from the
flags (the one place that reads --mode); a new mode is a new file here and one registry line.
"""

from __future__ import annotations

import dataclasses

from mpitrain.core.layout import CHIEF, SERVER, WORKER
from mpitrain.duties.observe import ALLREDUCE


@dataclasses.dataclass
class Trained:
    """What a role's loop leaves on its rank: rank 0's and a server's state (chief.ServerState),
    a worker's result (gradients.WorkerResult); the one-process run has both."""

    state: object = None
    worker: object = None


class Mode:
    """The interface every mode fills in. `run(ctx, progress)` is the only way a rank trains;
    `progress` is the job's bar on rank 0 and None elsewhere."""

    name = ""  # the summary's and the log's "mode"
    # A global step is one averaged update of every worker's (or Q's) gradient, so a worker's
    # count in the summary is its contributions; otherwise each gradient is a global step.
    averages = False
    worker_comm = False  # the workers need a communicator of their own (the sync Allreduce)
    # Its updates take their batches from the job's deal in step order (core/ledger.SyncDeal): the states
    # it keeps and saves say how far the deal got (TrainState.dealt).
    deals = False
    # The deal's last step may hold fewer batches than workers (the others weigh 0 in it); --quorum deals
    # whole steps only (sync.sync_total), and its budget is reached with fewer left than workers.
    short_last_step = True
    # Its updates may leave a step's batches out (--quorum's Q of W): the coordinator counts them by epoch and
    # sends the counts to rank 0 with each state it saves (TAG_LEFT_OUT), for the checkpoint and the summary.
    leaves_out = False
    # Rank 0 lends its workers blocks of the deal with each reply (core/ledger.Leases: async over messages).
    leases = False

    def worker_arrays(self, cfg) -> tuple[str, ...]:
        """The arrays each worker holds for itself that its checkpoints keep, a row per worker
        (TrainState.per_worker), so that a resume goes on as if never stopped: plain sync's error-feedback
        residual (--compress int8|int4, --sparsify) and, with --local-steps, its inner optimizer's state.
        The coordinator gathers them where it saves and sends them to rank 0 with the state (TAG_PER_WORKER).
        Async's and --quorum's workers keep theirs to themselves: a resume starts them afresh."""
        return ()

    def run(self, ctx, progress=None) -> Trained:
        """This rank's part of the run, by its role (Layout.role)."""
        return {CHIEF: self.chief, SERVER: self.server, WORKER: self.worker}[ctx.role](ctx, progress)

    def chief(self, ctx, progress) -> Trained:
        raise NotImplementedError

    def server(self, ctx, progress) -> Trained:
        raise NotImplementedError

    def worker(self, ctx, progress) -> Trained:
        raise NotImplementedError

    def worker_batches_per_step(self, workers: int) -> int:
        """How many worker batches one global step takes, on average: the budget of --epochs."""
        return 1 if self.averages else workers

    def global_batch(self, cfg, workers: int) -> int:
        """Examples behind one global step."""
        return cfg.batch_size

    def quorum(self, cfg, workers: int) -> int | None:
        """The summary's quorum: the gradients averaged into one update (None: not averaged)."""
        return None

    def why_no_regroup(self) -> str | None:
        """Why a lost worker ends a job of this mode whatever the flags (None: it may regroup)."""
        return "Async cannot go on"

    def start_words(self, cfg, workers: int) -> str | None:
        """What this mode decided for this many workers, for rank 0's start lines (None: nothing)."""
        return None

    def exchange_words(self, cfg, n: int, workers: int) -> str | None:
        """What a worker sends an exchange of `n` values when --compress int8|int4 or --sparsify compresses it,
        for rank 0's start lines (None: the exchange as ever)."""
        return None

    def waits_for(self, cfg, workers: int) -> str:
        """What rank 0 waits for while no global step comes (the --stall-warning line)."""
        return "waiting for a gradient"

    # The activity phases (observe.py) in which a worker waits on the other workers rather than on
    # rank 0: its own stall line would blame the wrong rank, so rank 0's says who is late.
    waits_on_workers = frozenset({ALLREDUCE})
