"""The per-rank context: who I am, what I compute on, what I train, and on which data.

`setup()` does everything that can fail because of the user's input (flags, data, GPU) before
any rank talks to another about training, so that a failure is agreed on by every rank and
reported once (see cli.py).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpitrain.core.backend import Backend, make_backend
from mpitrain.core.config import NPZ_PREFIX, TrainConfig, UsageError
from mpitrain.core.console import say
from mpitrain.core.data import Dataset, check_batch_fits, load_dataset, steps_per_epoch
from mpitrain.core.layout import PS_RANK, WORKER, Layout
from mpitrain.core.ledger import Deal
from mpitrain.core.model import Model, build
from mpitrain.core.optim import decayed_lr, preload_blas
from mpitrain.core.outer import falls_due
from mpitrain.core.stop import STOP, StopRequest
from mpitrain.core.worldcheck import validate_for_world
from mpitrain.duties import checkpoint
from mpitrain.duties.metrics import JobOutputs
from mpitrain.duties.observe import Activity
from mpitrain.launch import lock, mpiimpl
from mpitrain.launch.faults import copying_backend_for
from mpitrain.node import Node

__all__ = ["PS_RANK", "Context", "Layout", "setup", "start_state"]


def _no_watch():
    from mpitrain.membership.liveness import NoWatch  # liveness imports MPI, which world() must initialise first

    return NoWatch()


@dataclass(frozen=True)
class Context:
    """Everything one rank's run needs, complete when made and never changed after: setup() makes
    it from the flags, the data and the model (no communication); the trainer's `connect` makes
    the connected copy (dataclasses.replace) with the sync workers' communicator, the heartbeat
    watch and this rank's activity record. Until then those are inert: no communicator, a watch
    that never declares anyone lost, an activity record nobody reads."""

    cfg: TrainConfig
    comm: object  # MPI.COMM_WORLD
    rank: int
    size: int
    node: Node
    host: str
    backend: Backend
    data: Dataset
    model: Model
    layout: Layout
    resume: tuple[Path, checkpoint.TrainState] | None = None  # rank 0: the newest checkpoint in --checkpoint-dir
    mode: object = None  # modes.base.Mode: how this run trains, and what a global step is (modes.of)
    worker_comm: object = None  # sync mode: the workers only (rank 0 is not in the hot collective)
    watch: object = field(default_factory=_no_watch)  # liveness.Watch (or NoWatch): the peers this rank waits on
    activity: Activity = field(default_factory=Activity)  # what this rank is doing (phases, step times, --timeline)
    start: checkpoint.TrainState | None = None  # what training starts from, broadcast by rank 0 (connect)
    outputs: JobOutputs = field(default_factory=JobOutputs)  # rank 0's bar and log, the job's (join.Carry's)
    handover: object = None  # rank 0, the phase after a take-over: failover.Handover (the state it starts from)
    stop: StopRequest = STOP  # what ends this phase at a step boundary: a stop, or room to make (core/stop.py)

    @property
    def single(self) -> bool:
        """One process: train with no parameter server."""
        return self.layout.single

    @property
    def workers(self) -> int:
        return self.layout.workers

    @property
    def is_ps(self) -> bool:
        return self.layout.is_server(self.rank)

    @property
    def worker_index(self) -> int:
        """0-based index among workers (the single process is worker 0)."""
        return self.layout.worker_index(self.rank)

    @property
    def role(self) -> str:
        return self.layout.role(self.rank)

    @property
    def regroups(self) -> bool:
        """Sync (--quorum too) goes on without a lost worker: the workers left regroup on rank 0's
        word (elastic.py)."""
        return self.why_no_regroup is None

    @property
    def why_no_regroup(self) -> str | None:
        """Why a lost worker would end this job rather than the workers left regroup (rank 0's
        line says it), or None. Regrouping needs sync, heartbeats (rank 0 notices the loss) and one
        server (a second one would have to follow the new coordinator too)."""
        cfg = self.cfg
        if cfg.on_lost_worker == "stop":
            return "--on-lost-worker stop ends the job"
        why = self.mode.why_no_regroup()
        if why:
            return why
        if self.layout.shards > 1:
            return f"Sync with --num-ps {self.layout.shards} cannot regroup without it"
        if cfg.worker_timeout <= 0:
            return "With --worker-timeout 0 nobody tells the others to regroup"
        return None

    def eval_due(self, step: int, span: int = 1) -> bool:
        """--eval-every: rank 0 evaluates after global step `step` (or after any of the `span` steps an update
        ending at `step` made: async --local-steps)."""
        return falls_due(self.cfg.eval_every, step, span)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.data.n_train, self.workers, self.cfg.batch_size)

    def deal(self, state) -> Deal:
        """What every epoch of the job is (core/ledger.py): cut for the workers it first started with,
        which `state` (a TrainState or rank 0's ServerState) keeps once a sync run has dealt (a regroup,
        a join or a resume keeps them)."""
        cfg = self.cfg
        return Deal(self.data.n_train, cfg.batch_size, state.deal_shards or self.layout.started_workers, cfg.seed)

    def dealt(self, state) -> int:
        """How far the deal got in `state`; one from before the ledger (an older checkpoint) took a batch
        of each shard per sync step, one batch per async step."""
        return state.dealt if state.dealt is not None else state.global_step * (self.deal(state).shards
                                                                                if self.mode.deals else 1)

    def budget_reached(self, state) -> bool:
        """Whether `state` (a TrainState or rank 0's ServerState) is where training ends: --steps, or
        --epochs' worth of the deal (sync; a loss or a join changes the steps that takes), or the
        global step budget (the others)."""
        if not self.mode.deals or state.dealt is None:
            return state.global_step >= self.global_step_budget
        end = self.deal_end(self.deal(state))
        if end is not None and not self.mode.short_last_step:  # --quorum: fewer left than workers are never dealt
            end -= self.workers - 1
        steps = self.cfg.steps
        return (steps is not None and state.global_step >= steps) or (end is not None and state.dealt >= end)

    def deal_end(self, deal: Deal) -> int | None:
        """The batch number at which --epochs run out (None: only --steps ends the run)."""
        epochs = self.cfg.epochs_or_default
        return None if epochs is None else epochs * deal.per_epoch

    @property
    def global_step_budget(self) -> int:
        """The global step at which training ends: --steps, or where --epochs run out, whichever
        comes first. Sync: one global step per batch of every worker; async: one per worker batch."""
        cfg = self.cfg
        budgets = [] if cfg.steps is None else [cfg.steps]
        epochs = cfg.epochs_or_default
        if epochs is not None:
            # Counted in the epochs of the workers the job started with: a worker lost (sync,
            # elastic.py) changes the shards, not where the run ends.
            workers = self.layout.started_workers
            per_step = self.mode.worker_batches_per_step(workers)
            budgets.append(epochs * steps_per_epoch(self.data.n_train, workers, cfg.batch_size) * per_step)
        return min(budgets)

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that makes global step `step + 1`: scaled with the
        workers in a sync update (--lr-scaling, after --warmup-epochs), decayed by the epochs of
        global data seen before it (--lr-decay)."""
        lr, decay, batch, n_train, k, warm = self._lr_constants
        seen = step * batch
        return decayed_lr(lr, decay, seen, n_train) * warmed_up(k, warm, seen, n_train)

    @functools.cached_property
    def _lr_constants(self) -> tuple[float, float, int, int, int, float]:
        """lr_at's inputs that the phase fixes, looked up once: lr_at runs for every update (a shm
        worker's push, rank 0's apply), and the lookups through the flags' and the mode's properties
        took 4-9 us of a softmax push's ~70 (0.4 us now; 2026-11-29). A cached_property writes the
        instance's __dict__ directly, which a frozen dataclass allows."""
        cfg = self.cfg
        return cfg.learning_rate, cfg.lr_decay, self.global_batch, self.data.n_train, self.lr_scale, cfg.warmup_epochs

    @property
    def lr_scale(self) -> int:
        """The factor --lr-scaling linear reaches: the gradients averaged into one sync update."""
        return self.global_batch // self.cfg.batch_size if self.cfg.scaled_lr else 1

    @property
    def global_batch(self) -> int:
        """Examples behind one global step: one worker's batch in async; in sync, the batches of
        the Q (--quorum) or all workers averaged into the update."""
        return self.mode.global_batch(self.cfg, self.workers)

    @property
    def fingerprint(self) -> dict:
        return fingerprint(self.cfg, self.data, self.model)

    @property
    def shard(self) -> slice:
        """The slice of the flat parameters this server rank owns (the whole vector with one server)."""
        return self.layout.shard_slice(self.layout.shard_index(self.rank), self.model.n_params)

    def placement(self) -> str:
        """The seeds' log_device_placement, one line per rank."""
        lay = self.layout
        role = "single" if lay.single else ("worker" if self.role == WORKER else "parameter-server")
        if self.is_ps and lay.shards > 1:
            k, s = lay.shard_index(self.rank), self.shard
            if self.cfg.ps_transport == "shm":  # the store holds every shard; the workers apply them there
                role += f" shard {k}/{lay.shards} (its {s.stop - s.start:,} params are in the host's shared store"
                role += ", applied by the workers)" if k == 0 else "; this rank holds nothing and waits for the end)"
            else:
                role += f" shard {k}/{lay.shards} ({s.stop - s.start:,} params)"
        return f"rank {self.rank} {role} {self.host} {self.backend.description}"


def rank_backend(cfg: TrainConfig, layout: Layout, rank: int, node: Node) -> Backend:
    """This rank's arrays: a worker's on --device; a server's on --ps-device (the host by default:
    with a CPU server, the updates are applied on the very buffers it sends). MPITRAIN_TEST_BACKEND
    (faults.py) swaps a server's for a NumPy backend that copies like a GPU one, for the tests."""
    mpi_reads_gpu = mpiimpl.mpi_cuda_support() if cfg.cuda_aware else None  # asked only when it matters
    if not layout.is_server(rank):
        return make_backend(cfg.device, node.rank, cuda_aware=cfg.cuda_aware, mpi_reads_gpu=mpi_reads_gpu)
    if cfg.ps_device == "gpu":  # async only (validate)
        return make_backend("gpu", node.rank, cuda_aware=cfg.cuda_aware, flag="--ps-device", mpi_reads_gpu=mpi_reads_gpu)
    return copying_backend_for("server") or make_backend("cpu", node.rank)


def make_model(cfg: TrainConfig, data: Dataset, xp) -> Model:
    """--model NAME for this data, or the user's own model object (the API), on this rank's array
    module; a user's model must fit the data (its sizes: features first, classes last)."""
    if isinstance(cfg.model, str):
        return build(cfg.model, data.n_features, cfg.hidden, data.n_classes, cfg.l2, xp)
    model = cfg.model.with_backend(xp)
    sizes = tuple(model.sizes)
    if (sizes[0], sizes[-1]) != (data.n_features, data.n_classes):
        raise UsageError(f"your model {model.description} takes {sizes[0]} features and gives {sizes[-1]} classes, "
                         f"but {data.name} has {data.n_features} features and {data.n_classes} classes; build it "
                         f"with sizes ({data.n_features}, ..., {data.n_classes})")
    return model


def fingerprint(cfg: TrainConfig, data: Dataset, model: Model) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    npz = cfg.dataset.startswith(NPZ_PREFIX) and os.path.abspath(cfg.dataset[len(NPZ_PREFIX):])
    return checkpoint.fingerprint(model.sizes, cfg.optimizer, data.name, cfg.seed, model.spec, npz or None)


def check_launch(size: int, env=os.environ) -> None:
    """Plain `srun python -m mpitrain` without PMI starts N singletons that each train alone."""
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if ntasks and ntasks.isdigit() and int(ntasks) > 1 and size == 1:
        raise UsageError(f"Slurm started {ntasks} tasks but MPI sees a world of 1: launch with "
                         f"`{mpiimpl.slurm_hint()}` (or `mpirun -np $SLURM_NTASKS ...`)")


def check_output_path(flag: str, path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    try:  # made as --log-dir and --checkpoint-dir make theirs
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a folder should be, no permission, a read-only mount
        raise UsageError(f"{flag} {path}: cannot create the folder {parent} ({e.strerror}); pick another path") from None
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name, e.g. {Path(path) / 'out.json'}")
    try:  # writable (a read-only mount, no permission) is only known by trying: a file that vanishes at once
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write to {parent} ({e.strerror}); pick a folder you can write "
                         f"to") from None


def warmed_up(k: int, warm_epochs: float, samples_seen: int, n_train: int) -> float:
    """Goyal et al.'s gradual warm-up: the learning rate's factor, linear from 1 to `k` (lr_scale)
    over `warm_epochs` epochs of global data."""
    if k == 1 or warm_epochs <= 0:
        return float(k)
    return 1.0 + (k - 1) * min(1.0, samples_seen / (warm_epochs * n_train))


def load_inputs(cfg: TrainConfig) -> Dataset:
    """What a process loads before it can train, before it meets the other ranks: the dataset and,
    for the shm store's one-pass apply, SciPy's BLAS (optim.preload_blas, ~0.4 s). A joiner, a
    respawned worker and a spare load them while the job trains on (phases.py), not once it waits."""
    data = load_dataset(cfg)
    preload_blas(cfg)
    return data


def setup(cfg: TrainConfig, comm, node: Node, choose_mode, data: Dataset | None = None) -> Context:
    """Raises UsageError for anything the user must fix. Performs no communication. `choose_mode`
    (modes.of, passed in: the modes build on this module) picks the mode from the flags and layout.
    `data`: what load_inputs gave this process for an earlier phase or before it joined (join.Carry),
    not loaded again."""
    rank, size = comm.Get_rank(), comm.Get_size()
    check_launch(size)
    validate_for_world(cfg, size)
    if cfg.ps_transport == "shm" and cfg.num_ps > 1 and node.size != size:  # the same answer on every rank
        raise UsageError(f"--ps-transport shm with --num-ps {cfg.num_ps} keeps every shard in one host's memory, but "
                         f"this job's {size} ranks run on several hosts; use --num-ps 1 (the workers on other hosts "
                         f"then send their gradients to rank 0) or --ps-transport mpi")
    if rank == PS_RANK:  # rank 0 writes them at the end: a bad folder must not cost the run
        for flag, path in (("--summary-json", cfg.summary_json), ("--timeline", cfg.timeline)):
            check_output_path(flag, path)
        # One job per folder, before anything in them is read or written (lock.py; released by trainer.run).
        for line in lock.acquire_folders([("--checkpoint-dir", cfg.checkpoint_dir), ("--log-dir", cfg.log_dir)]):
            say(line, sys.stderr)
    layout = Layout(size, cfg.num_ps)
    node = node.for_layout(layout)
    backend = rank_backend(cfg, layout, rank, node)
    data = data if data is not None else load_inputs(cfg)
    check_batch_fits(data.n_train, layout.workers, cfg.batch_size)
    model = make_model(cfg, data, backend.xp)
    resume = None
    if rank == PS_RANK and cfg.checkpoint_dir and not cfg.fresh:
        resume = checkpoint.load_latest(Path(cfg.checkpoint_dir), fingerprint(cfg, data, model))
    return Context(cfg, comm, rank, size, node, socket.gethostname(), backend, data, model, layout, resume,
                   choose_mode(cfg, layout))


def start_state(ctx: Context) -> checkpoint.TrainState:
    """The state this rank's training starts from (connected contexts have it)."""
    return ctx.start


def broadcast_start(ctx: Context) -> checkpoint.TrainState:
    """Rank 0 initialises the parameters (or takes them from the checkpoint it resumes) and
    broadcasts them with the optimizer state, the global step and each worker's data position (sync: the deal's);
    workers never initialise their own. Called once, at start, on every rank."""
    from mpi4py import MPI

    W = ctx.workers
    if ctx.rank == PS_RANK:
        if ctx.handover is not None:  # rank 0 was lost: the survivors' freshest state (failover.py)
            state = ctx.handover.state
            state.per_worker = {}  # (a take-over's phase: each worker's own arrays start afresh)
        else:
            state = ctx.resume[1] if ctx.resume else checkpoint.TrainState(ctx.model.init_params(ctx.cfg.seed))
        # a run resumed with another number of workers re-shards: positions beyond the saved ones start at 0
        state.positions = [state.position(w) for w in range(W)]
        if ctx.single:
            return state
    else:
        state = checkpoint.TrainState(np.empty(ctx.model.n_params, np.float32), positions=[0] * W)
    names = checkpoint.state_arrays(ctx.cfg)[1:]  # the optimizer's state, the moving average
    head = np.array([state.global_step, state.opt_t, *(state.array(a) is not None for a in names), *state.positions],
                    np.int64)
    ctx.comm.Bcast([head, MPI.INT64_T], root=PS_RANK)
    state.global_step, state.opt_t = int(head[0]), int(head[1])
    state.positions = [int(p) for p in head[2 + len(names):]]
    checkpoint.bcast_ledger(ctx.comm, state, state, PS_RANK)
    ctx.comm.Bcast([state.params, MPI.FLOAT], root=PS_RANK)
    for name, present in zip(names, head[2:]):
        if present:
            arr = state.array(name) if ctx.rank == PS_RANK else np.empty(ctx.model.n_params, np.float32)
            ctx.comm.Bcast([arr, MPI.FLOAT], root=PS_RANK)
            state.set_array(name, arr)
    names = ctx.mode.worker_arrays(ctx.cfg)
    if names:
        state.per_worker = checkpoint.bcast_per_worker(ctx.comm, state.per_worker, names, ctx.model.n_params, PS_RANK)
        rows = len(state.per_worker[names[0]]) if state.per_worker else W
        if rows != W and ctx.rank == PS_RANK:
            say(f"each worker's own state ({worker_arrays_words(names)}) is not resumed: the checkpoint kept it for "
                f"{rows} worker{'s' if rows != 1 else ''}, this run has {W}")
    return state


def worker_arrays_words(names: tuple[str, ...]) -> str:
    """Mode.worker_arrays' names as a user reads them."""
    words = ["error feedback"] if checkpoint.RESIDUAL in names else []
    if checkpoint.OWN_MODEL in names:
        words.append("its own steps since the last outer step")
    if any(name.startswith(checkpoint.INNER) for name in names):
        words.append("the inner optimizer's state")
    return ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1]


def nothing_to_train(ctx: Context) -> bool:
    """The run resumed from a checkpoint that has reached the budget already (a re-run of a
    finished job, a Slurm requeue or `afterany` chain, or a smaller --steps): every rank knows it
    from the start state, so none trains a step and rank 0 writes no new checkpoint."""
    return ctx.budget_reached(ctx.start)
