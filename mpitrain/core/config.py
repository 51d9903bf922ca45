"""TrainConfig: every training option and its default (config_checks.py: the checks on them).

This module is the one place that holds defaults; cli.py builds its parser from them.
It imports nothing heavy, so `--help` and bad flags answer fast, and NumPy loads only after cli.py
has pinned the BLAS threads (a test holds it to that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mpitrain.core.options import CHECKPOINTS, DATA, DEVICE, MODEL, OUTPUT, PARALLELISM, TRAINING

MODES = ("async", "sync")

DATASETS = ("digits", "mnist", "fashion_mnist", "synthetic")
NPZ_PREFIX, TFDS_PREFIX = "npz:", "tfds:"  # --dataset npz:PATH (your own arrays), tfds:NAME (any tfds image classifier)
DATASET_PREFIXES = {NPZ_PREFIX: ("PATH", "a file", "npz:mydata.npz"), TFDS_PREFIX: ("NAME", "a dataset name", "tfds:kmnist")}
DEVICES = ("auto", "cpu", "gpu")
PS_DEVICES = ("cpu", "gpu")
WAITS = ("auto", "spin", "yield")
LOST_WORKER_CHOICES = ("continue", "stop")  # --on-lost-worker
LOST_SERVER_CHOICES = ("continue", "stop")  # --on-lost-server
LR_SCALINGS = ("linear", "none")
PS_TRANSPORTS = ("mpi", "shm")  # --ps-transport (exchange/mpi.py, exchange/shm.py)
JOINED_LINKS = ("shm", "mpi")  # --joined-link (exchange/mailbox.py)


def _names(module: str, table: str) -> Callable[[], tuple[str, ...]]:
    """A registry's names (--model's, --optimizer's, --compress's choices), imported when asked, not
    above: NumPy must not load before cli.py pins the BLAS threads."""

    def names() -> tuple[str, ...]:
        import importlib

        return tuple(getattr(importlib.import_module(f"mpitrain.core.{module}"), table))

    return names


model_names, optimizer_names = _names("model", "HIDDEN"), _names("optim", "REGISTRY")
codec_names = _names("compress", "NAMES")  # --compress: the elementwise codecs, then the gathered ones


def optimizer_lrs() -> str:
    """Each optimizer's default learning rate, as --help shows it: "sgd 0.1, momentum 0.01, adam 0.001"."""
    from mpitrain.core.optim import REGISTRY

    return ", ".join(f"{name} {kind.default_lr:g}" for name, kind in REGISTRY.items())


# Used when neither --epochs nor --steps is given: enough for digits to pass 93%.
DEFAULT_EPOCHS = 50
# Seconds of silence (no heartbeat, no message) after which a rank is declared lost. Heartbeats
# come from a thread, so a slow step never counts as silence.
DEFAULT_WORKER_TIMEOUT_S = 30.0
# Stop when the smoothed training loss exceeds this many times the run's starting loss (guard.py).
DEFAULT_DIVERGENCE_FACTOR = 100.0
# Sync --lr-scaling linear ramps the learning rate from --lr up to --lr x workers over this many
# epochs of global data (Goyal et al. 2017 used 5 on ImageNet; 1 suffices for MNIST-sized data).
DEFAULT_WARMUP_EPOCHS = 1.0
# A worker whose median step time is this many times the other workers' median is named slow.
DEFAULT_STRAGGLER_REPORT = 1.5
# Async's defaults as workers grow (benchmarks/QUALITY_SCALE.md: MNIST-sized, 2 to 16 workers): a gradient at
# most this many updates old is applied at the full learning rate, an older one at lr x K / staleness
# (--staleness-lr K). With 16 workers and no damping async did not learn (0.12-0.34 test accuracy); K 8 kept
# 2 workers' accuracy where K 1 (Zhang et al.'s lr / staleness) and K 4 lost 1-1.5 points by slowing every step.
DEFAULT_STALENESS_TOLERANCE = 8.0
# --overlap makes each gradient one exchange staler: about 2W - 1 updates old with W workers instead of W - 1.
# After 6 epochs of Fashion-MNIST (benchmarks/QUALITY_SCALE.md#2026-11-29-0031-utc-overlap) it cost 0.95 point at 3 workers and 3.0
# at 4 (medians of 3 seeds) for 5-6% more samples/s, and nothing measurable at 2 workers, where it made
# 1.22-1.43x the samples/s of --no-overlap. So it stays on for 2 workers only (the main job's np 3).
AUTO_OVERLAP_MAX_WORKERS = 2
# --local-steps' outer learning rate unless --outer-lr: sgd 1 is plain model averaging (local SGD),
# nesterov 0.7 (momentum 0.9) DiLoCo's (Douillard et al. 2023).
OUTER_DEFAULT_LR = {"sgd": 1.0, "nesterov": 0.7, "delayed-nesterov": 0.7}
OUTER_OPTIMIZERS = tuple(OUTER_DEFAULT_LR)  # --outer-optimizer's choices (outer.py)
# --outer-optimizer unless given, by mode (benchmarks/LOCAL_STEPS.md). Sync: nesterov (MNIST-sized, 4 workers,
# H 16: 0.950-0.9605 against plain averaging's 0.9425-0.9445). Async applies each push alone, so nesterov's
# momentum at every push compounds W pushes a round (digits: 0.12); delayed-nesterov moves it once a round.
# Fashion-MNIST, 6 epochs, medians of 3 seeds: 4 workers H 4 0.8675, H 16 0.8589 against sgd's 0.8522, 0.8326
# (plain sync 0.8584); 8 workers H 8 0.8404 against 0.8108. Undamped: --staleness-lr 8 cost it 0.4-1.1 points.
DEFAULT_OUTER_OPTIMIZER = {"sync": "nesterov", "async": "delayed-nesterov"}
# --outer-momentum unless given: DiLoCo's 0.9 over --optimizer sgd; 0.5 over an inner optimizer with a momentum
# of its own (momentum, adam: optim.OptimizerKind.own_momentum), whose velocity outlives a few inner steps and
# compounds with the outer one. Fashion-MNIST, 4 workers, 3 epochs, medians of 3 seeds (benchmarks/INNER_OUTER.md):
# at H 4 0.9 ended at 0.671 / 0.725 in sync and 0.168 / 0.626 in async (momentum / adam), 0.5 at 0.826 / 0.842 and
# 0.814 / 0.825; async H 16 0.774 / 0.783 against 0.828 / 0.841. Over sgd 0.9 is best (H 4: 0.859 sync, 0.854
# async, against 0.835 / 0.833 with 0.5).
# The same lower default under async --local-steps with --overlap, whose pushes are one push staler: asynchrony acts
# as momentum of its own (Mitliagkas et al. 2016, "Asynchrony begets momentum"). Fashion-MNIST, 4 workers, H 16,
# 2 epochs: 0.9 ended at 0.751 (seed 0) where the run without overlap reached 0.809; 0.5 at 0.811-0.812 (seeds 1-3)
# against 0.808-0.832 without overlap, 0.7 at 0.804-0.814, 0.8 at 0.780-0.804 (2026-12-06).
DEFAULT_OUTER_MOMENTUM = 0.9
DEFAULT_OUTER_MOMENTUM_OVER_MOMENTUM = 0.5
# --delay-compensation given without a value: the adaptive variant's lambda_0 in Zheng et al. 2017 (CIFAR-10, ImageNet).
DEFAULT_DC_LAMBDA = 2.0
# Seconds without a global step before the waiting rank says what it waits for (Horovod's stall
# inspector warns after 60 s too).
DEFAULT_STALL_WARNING_S = 60.0
# --timeline keeps every span of each rank's first N steps and about its last N.
DEFAULT_TIMELINE_STEPS = 100


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, on every rank."""


@dataclass(frozen=True)
class TrainConfig:
    """Every training option: the command line's flags (with underscores) and the Python API's keywords."""

    mode: str = TRAINING(
        "async", "async: each worker pushes gradients to and pulls parameters from the parameter server on its own; "
        "sync: the workers average their gradients with Allreduce every step", choices=MODES, first=True)
    num_ps: int = PARALLELISM(
        1, "parameter servers: ranks 0..K-1 each own one slice of the parameters (and its optimizer state); "
        "rank 0 stays the chief that evaluates, logs and checkpoints", metavar="K")
    overlap: bool | None = PARALLELISM(
        None, "async: receive the next parameters while computing the next gradient (one exchange staler, "
        "no idle round trip); with --local-steps H, the next H steps from the worker's own model",
        shown=f"on up to {AUTO_OVERLAP_MAX_WORKERS} workers, off above and with --local-steps")
    ps_transport: str = PARALLELISM(
        "mpi", "async: mpi (each gradient a message that rank 0 applies) or shm (the parameters in rank 0's host's "
        "shared memory, each worker there applies its own gradient under a lock; workers on other hosts send theirs "
        "to rank 0, which applies them into the same store)",
        choices=PS_TRANSPORTS)
    joined_link: str = PARALLELISM(
        "shm", "async over mpi: how rank 0 exchanges with a worker on its host that another launch started "
        "(--respawn, --join): shm (a shared-memory mailbox) or mpi (MPI's link between launches: UCX or TCP, "
        "0.70x as fast)", choices=JOINED_LINKS)
    compress: str = PARALLELISM(
        "none", "send gradients and parameters as float16 or bfloat16 (half the bytes; bf16 converts faster on a "
        "CPU); or each worker's gradient as int8, int4 or int2 (a scale per 256 values, error feedback); update in "
        "float32",
        choices=codec_names)
    sparsify: float | None = PARALLELISM(
        None, "each worker's exchange sends only the P percent of entries largest in magnitude (top-k, with error "
        "feedback; with --compress none, int8, int4 or int2)", shown="every entry", metavar="P")
    compress_replies: bool = PARALLELISM(
        False, "with --compress int8|int4 or --sparsify: async, rank 0's replies too, each the parameters' change "
        "since what that worker holds, in the same scheme (what one reply holds back, the next carries); sync, the "
        "sums too: a reduce-scatter of compressed chunks, each worker receiving 2(W-1)/W of a part, not W-1 parts")
    quorum: int | None = PARALLELISM(
        None, "sync: each update averages the first Q fresh gradients; later ones are dropped and counted",
        shown="every worker, a plain Allreduce", metavar="Q", first=True)
    local_steps: int = PARALLELISM(
        1, "each worker takes H steps on its own, then how far it moved is applied with the outer optimizer "
        "(local SGD, DiLoCo): sync averages the workers' (one Allreduce every H steps instead of every step; "
        "--quorum Q: the first Q to finish), async pushes each worker's on its own; 1: every gradient", metavar="H", first=True)
    outer_optimizer: str | None = PARALLELISM(
        None, "--local-steps H: the outer optimizer: nesterov (DiLoCo's), delayed-nesterov (async: its momentum "
        "once every W pushes, Liu et al. 2024) or sgd (with --outer-lr 1: plain model averaging)", choices=OUTER_OPTIMIZERS, shown=", ".join(f"{v} in {k}" for k, v in DEFAULT_OUTER_OPTIMIZER.items()))
    outer_lr: float | None = PARALLELISM(
        None, "--local-steps H: the outer learning rate", shown=", ".join(f"{k} {lr:g}" for k, lr in OUTER_DEFAULT_LR.items()), metavar="LR")
    outer_momentum: float | None = PARALLELISM(
        None, "--local-steps H with (delayed-)nesterov: the outer momentum", metavar="M",
        shown=f"{DEFAULT_OUTER_MOMENTUM:g}, {DEFAULT_OUTER_MOMENTUM_OVER_MOMENTUM:g} over an --optimizer with its own "
        "momentum (momentum, adam) or with async's --overlap")
    outer_overlap: int | None = PARALLELISM(
        None, "sync with --local-steps H: send each outer step's exchange and keep computing, its outer step landing "
        "T inner steps later (0 to H - 1; Streaming DiLoCo's overlap): the link's time hides behind compute",
        shown="off", metavar="T")
    fragments: int = PARALLELISM(
        1, "sync with --local-steps H: each outer step averages 1/F of the parameters, fragment f every H steps from "
        "step f x H/F (Streaming DiLoCo's fragments): the link's peak load 1/F, the same bytes in all", metavar="F")
    max_staleness: int | None = PARALLELISM(
        None, "async: hold back a worker's reply so that no applied gradient is more than S updates stale "
        "(implies --no-overlap; with --local-steps, S outer steps)", shown="unbounded", metavar="S")
    staleness_lr: float | None = PARALLELISM(
        None, "async: scale each step's learning rate by min(1, K / its gradient's staleness): full for "
        "gradients at most K updates old; the flag alone: K 1, lr / staleness (Zhang et al. 2016); 0: off. "
        "--local-steps: the outer step's, staleness in global steps, never below 1 / the workers; off by "
        "default with delayed-nesterov", shown=f"K {DEFAULT_STALENESS_TOLERANCE:g}", metavar="K", bare=1.0)
    delay_compensation: float | None = PARALLELISM(
        None, "async: correct each gradient for the updates applied since its worker was sent its parameters, "
        "g + LAMBDA * g*g*(w_now - w_sent) / sqrt(mean g*g) (DC-ASGD, Zheng et al. 2017); the flag alone: "
        f"LAMBDA {DEFAULT_DC_LAMBDA:g}", shown="off", metavar="LAMBDA", bare=DEFAULT_DC_LAMBDA)
    stragglers: tuple[tuple[int, str, float], ...] = PARALLELISM(  # (rank, "delay"|"factor", value)
        (), "slow worker RANK down on every step by SEC seconds, or F times (repeatable; for tests and demos)",
        shown="none", metavar="RANK:SEC|RANK:xF", flag="--straggler")
    wait: str = PARALLELISM(
        "auto", "how workers wait in Allreduce: spin (MPICH's blocking call) or yield (test and sleep); "
        "auto yields when a node has more computing ranks than cores", choices=WAITS)
    worker_timeout: float = PARALLELISM(
        DEFAULT_WORKER_TIMEOUT_S, "declare a rank lost after SEC seconds without a heartbeat, or at once when it is on "
        "this host and its process has ended (0: never); async goes on without a lost worker under `mpirun "
        "-disable-auto-cleanup`", metavar="SEC", first=True)

    on_lost_worker: str = PARALLELISM(
        "continue", "when a worker is lost (under the launcher's keep-going flag): go on with the others (sync: they "
        "regroup and re-shard; --quorum Q: while Q are left) or stop the job (exit 5; resume from a checkpoint)",
        choices=LOST_WORKER_CHOICES)
    on_lost_server: str = PARALLELISM(
        "stop", "when rank 0 is lost (under the launcher's keep-going flag): stop (every worker ends in one line; "
        "its newest checkpoint resumes the job) or continue (the workers agree on a successor, the lowest rank "
        "left, which becomes rank 0 with the freshest model they hold; 57 of 58 chaos trials went on, but the "
        "job is one worker smaller and async loses a few updates, so stop stays the default)",
        choices=LOST_SERVER_CHOICES)
    join: bool = PARALLELISM(
        False, "start this process as one more worker of the job running with the same flags and --checkpoint-dir: "
        "`mpirun -np 1 python -m mpitrain [the job's flags] --join` (MPICH; the job makes room at a step boundary)")
    respawn: int = PARALLELISM(
        0, "replace a lost worker: at the next step boundary the job starts a new one (MPI_Comm_spawn), which "
        "trains on from there (MPICH and Open MPI), at most N times in the job; needs --checkpoint-dir and "
        "--worker-timeout > 0",
        metavar="N")

    spares: int = PARALLELISM(
        0, "the last N ranks mpirun starts wait as hot spares; a lost worker's place goes to one at the next step "
        "boundary, before --respawn starts a process (needs --checkpoint-dir, --worker-timeout > 0)", metavar="N")

    model: str = MODEL("mlp", "softmax regression, or a ReLU multi-layer perceptron", choices=model_names, first=True)
    hidden: tuple[int, ...] = MODEL((100,), "MLP hidden layer widths", shown="100", metavar="W[,W...]", first=True)
    l2: float = MODEL(0.0, "L2 weight decay on the weights (not the biases)", metavar="L")

    # the seeds' GradientDescentOptimizer by default; momentum + async staleness is fragile
    optimizer: str = TRAINING("sgd", "the update rule, on the flat parameter vector", choices=optimizer_names, first=True)
    lr: float | None = TRAINING(
        None, "learning rate", shown=lambda: "the optimizer's: " + optimizer_lrs(), metavar="LR", first=True)
    lr_decay: float = TRAINING(
        0.99, "multiply the learning rate by this per epoch of global data (1: constant)", metavar="D")
    lr_scaling: str | None = TRAINING(  # None: "linear" in sync, "none" in async (see scaled_lr)
        None, "sync: multiply --lr by the gradients averaged per update, as Horovod (linear), or keep it (none)",
        shown="linear in sync, none in async", choices=LR_SCALINGS)
    warmup_epochs: float = TRAINING(
        DEFAULT_WARMUP_EPOCHS, "sync with linear scaling: ramp the learning rate up from --lr over E epochs of "
        "global data", metavar="E")
    momentum: float = TRAINING(0.9, "momentum coefficient (--optimizer momentum)", metavar="M")
    ema_decay: float | None = TRAINING(
        None, "keep a moving average of the weights (e.g. 0.99), evaluated beside them and checkpointed",
        shown="off", metavar="D")
    batch_size: int = TRAINING(100, "examples per worker and step", metavar="N", first=True)
    epochs: int | None = TRAINING(
        None, "passes of each worker over its shard of the data",
        shown=f"{DEFAULT_EPOCHS}, or none when --steps is given", metavar="E", first=True)
    steps: int | None = TRAINING(None, "stop at this global step", shown="no limit", metavar="N", first=True)
    seed: int = TRAINING(0, "seeds initialisation, shuffling and synthetic data", metavar="N", first=True)
    divergence_factor: float = TRAINING(
        DEFAULT_DIVERGENCE_FACTOR, "stop (exit 4) when the smoothed training loss exceeds F times the loss the "
        "run started from (0: only a non-finite loss stops it)", metavar="F")

    dataset: str = DATA(
        "digits", "digits (bundled, offline), mnist, fashion_mnist, synthetic, npz:PATH (your arrays "
        "x_train, y_train, x_test, y_test) or tfds:NAME (a prepared tensorflow-datasets classifier)", metavar="NAME", first=True)
    data_dir: str | None = DATA(
        None, "folder with MNIST-format IDX .gz files, or a tensorflow-datasets data dir",
        shown="tensorflow-datasets' own", metavar="DIR", first=True)
    train_split: str = DATA("train", "tfds:NAME only: the split to train on", metavar="SPLIT")
    test_split: str = DATA("test", "tfds:NAME only: the split to evaluate on", metavar="SPLIT")
    synthetic_samples: int = DATA(12000, "--dataset synthetic: examples (train and test together)", metavar="N")
    synthetic_features: int = DATA(784, "--dataset synthetic: features per example", metavar="D")

    device: str = DEVICE(
        "auto", "auto: CuPy on a GPU when one is usable, else NumPy; each worker takes GPU "
        "(node-local rank mod GPUs)", choices=DEVICES, first=True)
    cuda_aware: bool = DEVICE(
        False, "hand GPU buffers straight to MPI (a CUDA-aware MPI build) instead of staging them through host memory")
    ps_device: str = DEVICE(
        "cpu", "async: where the parameter servers hold their shard and apply the updates: cpu (NumPy), or gpu "
        "(CuPy, the GPU of the server's node-local rank)", choices=PS_DEVICES)

    checkpoint_dir: str | None = CHECKPOINTS(
        None, "save checkpoints here, and resume from the newest one found here", shown="no checkpoints",
        metavar="DIR", first=True)
    checkpoint_every_secs: float = CHECKPOINTS(60.0, "save every S seconds", metavar="S")
    checkpoint_every_steps: int | None = CHECKPOINTS(None, "also save every N global steps", shown="off",
                                                     metavar="N")
    keep_checkpoints: int = CHECKPOINTS(3, "keep the newest K checkpoints", metavar="K")
    fresh: bool = CHECKPOINTS(False, "start from scratch; earlier checkpoints move to a superseded-* folder", first=True)

    eval_every: int | None = OUTPUT(
        None, "evaluate rank 0's parameters on the test set every N global steps (summary: eval_history)",
        shown="at the end only", metavar="N", first=True)
    eval_at_end: bool = OUTPUT(
        False, "with --eval-every: copy rank 0's parameters at each such step and evaluate the copies after training, "
        "so that evaluating takes nothing from training (time to accuracy; one copy per evaluation in rank 0's memory)")
    log_dir: str | None = OUTPUT(None, "write events.jsonl and TensorBoard event files here (rank 0)",
                                 shown="no log", metavar="DIR", first=True)
    log_every: int = OUTPUT(10, "log the training scalars every N global steps", metavar="N")
    progress: bool = OUTPUT(True, "draw a progress bar on rank 0's stderr", first=True)
    summary_json: str | None = OUTPUT(None, "write the run's summary here as JSON", shown="none", metavar="PATH", first=True)
    straggler_report: float = OUTPUT(
        DEFAULT_STRAGGLER_REPORT, "name a worker whose step time and compute time per gradient are X times the "
        "other workers' (0: never)", metavar="X")
    stall_warning: float = OUTPUT(
        DEFAULT_STALL_WARNING_S, "after SEC seconds without a global step, say what is waited for (0: never)",
        metavar="SEC")
    timeline: str | None = OUTPUT(
        None, "write a Chrome/Perfetto trace of every rank's phases here (open it in ui.perfetto.dev)",
        shown="none", metavar="PATH")
    timeline_steps: int = OUTPUT(DEFAULT_TIMELINE_STEPS, "--timeline keeps each rank's first N steps and about "
                                 "its last N", metavar="N")

    @property
    def learning_rate(self) -> float:
        """--lr, or the optimizer's own default (optim.REGISTRY: Adam's 1e-3, as Keras and PyTorch)."""
        if self.lr is not None:
            return self.lr
        from mpitrain.core.optim import REGISTRY

        return REGISTRY[self.optimizer].default_lr

    @property
    def wire_dtype(self):
        """Element type of parameters and gradients on the wire (updates are always float32)."""
        from mpitrain.core.codec import CODECS, WIRE_DTYPES

        # int8 / int4 compress only sync's gathered parts (compress.py): every other wire is float32
        return WIRE_DTYPES[self.compress if self.compress in CODECS else "none"]

    def overlaps(self, workers: int) -> bool:
        """Async with this many workers: --overlap as given, else on up to AUTO_OVERLAP_MAX_WORKERS.
        --max-staleness works by holding back replies, which only binds a worker that waits for its
        reply before computing: it implies --no-overlap."""
        if self.max_staleness is not None or self.ps_transport == "shm":
            return False  # shm: no round trip to hide
        if self.local_steps > 1:  # the next H steps from the worker's own model (outer.InnerSteps): an option so far
            return bool(self.overlap)
        return self.overlap if self.overlap is not None else workers <= AUTO_OVERLAP_MAX_WORKERS

    @property
    def staleness_tolerance(self) -> float | None:
        """--staleness-lr's K in async (None: no damping)."""
        delayed = self.local_steps > 1 and self.outer_rule == "delayed-nesterov"  # a push moves lr / workers alone
        if self.mode != "async" or (delayed and self.staleness_lr is None):  # (DEFAULT_OUTER_OPTIMIZER)
            return None
        k = DEFAULT_STALENESS_TOLERANCE if self.staleness_lr is None else float(self.staleness_lr)
        return k or None

    @property
    def scaled_lr(self) -> bool:
        """Sync updates average the gradients of several workers' batches: as Horovod and Goyal et
        al. (2017), the learning rate grows with them. Async applies each gradient alone."""
        averaged = self.mode == "sync" and self.local_steps == 1  # --local-steps: each inner step is one batch's
        return (self.lr_scaling or ("linear" if averaged else "none")) == "linear"

    @property
    def inner_state_saved(self) -> bool:
        """Whether the --optimizer's state is part of the run's state (checkpoints, the start-up
        broadcast): not in async with --local-steps, where each worker's inner optimizer is its own."""
        return self.mode == "sync" or self.local_steps == 1

    @property
    def outer_learning_rate(self) -> float:
        return self.outer_lr if self.outer_lr is not None else OUTER_DEFAULT_LR[self.outer_rule]

    @property
    def outer_beta(self) -> float:
        """--outer-momentum, or its default over this --optimizer (DEFAULT_OUTER_MOMENTUM)."""
        if self.outer_momentum is not None:
            return self.outer_momentum
        from mpitrain.core.optim import REGISTRY

        own = REGISTRY[self.optimizer].own_momentum
        return DEFAULT_OUTER_MOMENTUM_OVER_MOMENTUM if own or self.eager else DEFAULT_OUTER_MOMENTUM

    @property
    def eager(self) -> bool:
        """Async --local-steps with --overlap: each push is computed before the reply to the last one lands."""
        return self.mode == "async" and self.local_steps > 1 and self.overlaps(0)

    def outer_beta_why(self) -> str:
        """For a start line, after the outer momentum: why it is the lower default, or nothing."""
        if self.outer_momentum is not None or self.outer_beta == DEFAULT_OUTER_MOMENTUM:
            return ""
        if self.eager:
            return ", lower since --overlap's pushes are one push staler; --outer-momentum sets another"
        return f", lower since --optimizer {self.optimizer} has its own; --outer-momentum sets another"

    @property
    def outer_rule(self) -> str:
        """--outer-optimizer, or its default in this mode (DEFAULT_OUTER_OPTIMIZER)."""
        return self.outer_optimizer or DEFAULT_OUTER_OPTIMIZER[self.mode]

    @property
    def alone_words(self) -> str:
        """What one process (no mpirun) does with --mode: not refused, as the flags that need workers
        are (worldcheck.py), since the run is the same either way, but said (it once was silent)."""
        return f"--mode {self.mode} trains locally, with no parameter server and no other worker"

    @property
    def epochs_or_default(self) -> int | None:
        """--epochs if given; the default only when no --steps budget was given either."""
        if self.epochs is not None:
            return self.epochs
        return None if self.steps is not None else DEFAULT_EPOCHS


def defaults() -> TrainConfig:
    return TrainConfig()


def can_take_joiners(cfg: TrainConfig) -> bool:
    """Whether a job with these flags lets workers join it (join.py) where its MPI can: it has
    --checkpoint-dir, where a joiner finds it, and heartbeats, which tell its workers to make room."""
    return bool(cfg.checkpoint_dir) and cfg.worker_timeout > 0
