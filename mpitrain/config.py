"""TrainConfig: every training option, its default, and the checks on it.

This module is the one place that holds defaults; cli.py builds its parser from them.
It imports nothing heavy, so `--help` and bad flags answer fast, and NumPy loads only after cli.py
has pinned the BLAS threads (a test holds it to that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mpitrain.options import CHECKPOINTS, DATA, DEVICE, MODEL, OPTIMISATION, OUTPUT, PARALLELISM

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


def _names(module: str, table: str) -> Callable[[], tuple[str, ...]]:
    """A registry's names (--model's, --optimizer's, --compress's choices), imported when asked, not
    above: NumPy must not load before cli.py pins the BLAS threads."""

    def names() -> tuple[str, ...]:
        import importlib

        return tuple(getattr(importlib.import_module(f"mpitrain.{module}"), table))

    return names


model_names, optimizer_names, codec_names = _names("model", "HIDDEN"), _names("optim", "REGISTRY"), _names("codec", "CODECS")


def optimizer_lrs() -> str:
    """Each optimizer's default learning rate, as --help shows it: "sgd 0.1, momentum 0.01, adam 0.001"."""
    from mpitrain.optim import REGISTRY

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
# After 6 epochs of Fashion-MNIST (benchmarks/QUALITY_SCALE-overlap.md) it cost 0.95 point at 3 workers and 3.0
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

    mode: str = PARALLELISM(
        "async", "async: each worker pushes gradients to and pulls parameters from the parameter server on its own; "
        "sync: the workers average their gradients with Allreduce every step", choices=MODES)
    num_ps: int = PARALLELISM(
        1, "parameter servers: ranks 0..K-1 each own one slice of the parameters (and its optimizer state); "
        "rank 0 stays the chief that evaluates, logs and checkpoints", metavar="K")
    overlap: bool | None = PARALLELISM(
        None, "async: receive the next parameters while computing the next gradient (one exchange staler, "
        "no idle round trip)", shown=f"on up to {AUTO_OVERLAP_MAX_WORKERS} workers, off above")
    ps_transport: str = PARALLELISM(
        "mpi", "async: mpi (each gradient a message that rank 0 applies) or shm (the parameters in rank 0's host's "
        "shared memory, each worker there applies its own gradient under a lock; workers on other hosts send theirs "
        "to rank 0, which applies them into the same store)",
        choices=PS_TRANSPORTS)
    compress: str = PARALLELISM(
        "none", "send gradients and parameters as float16 or bfloat16 (half the bytes; bf16 converts faster on a "
        "CPU); update in float32", choices=codec_names)
    quorum: int | None = PARALLELISM(
        None, "sync: each update averages the first Q fresh gradients; later ones are dropped and counted",
        shown="every worker, a plain Allreduce", metavar="Q")
    local_steps: int = PARALLELISM(
        1, "each worker takes H steps on its own, then how far it moved is applied with the outer optimizer "
        "(local SGD, DiLoCo): sync averages the workers' (one Allreduce every H steps instead of every step; "
        "--quorum Q: the first Q to finish), async pushes each worker's on its own; 1: every gradient", metavar="H")
    outer_optimizer: str | None = PARALLELISM(
        None, "--local-steps H: the outer optimizer: nesterov (DiLoCo's), delayed-nesterov (async: its momentum "
        "once every W pushes, Liu et al. 2024) or sgd (with --outer-lr 1: plain model averaging)", choices=OUTER_OPTIMIZERS, shown=", ".join(f"{v} in {k}" for k, v in DEFAULT_OUTER_OPTIMIZER.items()))
    outer_lr: float | None = PARALLELISM(
        None, "--local-steps H: the outer learning rate", shown=", ".join(f"{k} {lr:g}" for k, lr in OUTER_DEFAULT_LR.items()), metavar="LR")
    outer_momentum: float = PARALLELISM(0.9, "--local-steps H with (delayed-)nesterov: the outer momentum", metavar="M")
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
        "-disable-auto-cleanup`", metavar="SEC")

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

    model: str = MODEL("mlp", "softmax regression, or a ReLU multi-layer perceptron", choices=model_names)
    hidden: tuple[int, ...] = MODEL((100,), "MLP hidden layer widths", shown="100", metavar="W[,W...]")
    l2: float = MODEL(0.0, "L2 weight decay on the weights (not the biases)", metavar="L")

    # the seeds' GradientDescentOptimizer by default; momentum + async staleness is fragile
    optimizer: str = OPTIMISATION("sgd", "the update rule, on the flat parameter vector", choices=optimizer_names)
    lr: float | None = OPTIMISATION(
        None, "learning rate", shown=lambda: "the optimizer's: " + optimizer_lrs(), metavar="LR")
    lr_decay: float = OPTIMISATION(
        0.99, "multiply the learning rate by this per epoch of global data (1: constant)", metavar="D")
    lr_scaling: str | None = OPTIMISATION(  # None: "linear" in sync, "none" in async (see scaled_lr)
        None, "sync: multiply --lr by the gradients averaged per update, as Horovod (linear), or keep it (none)",
        shown="linear in sync, none in async", choices=LR_SCALINGS)
    warmup_epochs: float = OPTIMISATION(
        DEFAULT_WARMUP_EPOCHS, "sync with linear scaling: ramp the learning rate up from --lr over E epochs of "
        "global data", metavar="E")
    momentum: float = OPTIMISATION(0.9, "momentum coefficient (--optimizer momentum)", metavar="M")
    ema_decay: float | None = OPTIMISATION(
        None, "keep a moving average of the weights (e.g. 0.99), evaluated beside them and checkpointed",
        shown="off", metavar="D")
    batch_size: int = OPTIMISATION(100, "examples per worker and step", metavar="N")
    epochs: int | None = OPTIMISATION(
        None, "passes of each worker over its shard of the data",
        shown=f"{DEFAULT_EPOCHS}, or none when --steps is given", metavar="E")
    steps: int | None = OPTIMISATION(None, "stop at this global step", shown="no limit", metavar="N")
    seed: int = OPTIMISATION(0, "seeds initialisation, shuffling and synthetic data", metavar="N")
    divergence_factor: float = OPTIMISATION(
        DEFAULT_DIVERGENCE_FACTOR, "stop (exit 4) when the smoothed training loss exceeds F times the loss the "
        "run started from (0: only a non-finite loss stops it)", metavar="F")

    dataset: str = DATA(
        "digits", "digits (bundled, offline), mnist, fashion_mnist, synthetic, npz:PATH (your arrays "
        "x_train, y_train, x_test, y_test) or tfds:NAME (a prepared tensorflow-datasets classifier)", metavar="NAME")
    data_dir: str | None = DATA(
        None, "folder with MNIST-format IDX .gz files, or a tensorflow-datasets data dir",
        shown="tensorflow-datasets' own", metavar="DIR")
    train_split: str = DATA("train", "tfds:NAME only: the split to train on", metavar="SPLIT")
    test_split: str = DATA("test", "tfds:NAME only: the split to evaluate on", metavar="SPLIT")
    synthetic_samples: int = DATA(12000, "--dataset synthetic: examples (train and test together)", metavar="N")
    synthetic_features: int = DATA(784, "--dataset synthetic: features per example", metavar="D")

    device: str = DEVICE(
        "auto", "auto: CuPy on a GPU when one is usable, else NumPy; each worker takes GPU "
        "(node-local rank mod GPUs)", choices=DEVICES)
    cuda_aware: bool = DEVICE(
        False, "hand GPU buffers straight to MPI (a CUDA-aware MPI build) instead of staging them through host memory")
    ps_device: str = DEVICE(
        "cpu", "async: where the parameter servers hold their shard and apply the updates: cpu (NumPy), or gpu "
        "(CuPy, the GPU of the server's node-local rank)", choices=PS_DEVICES)

    checkpoint_dir: str | None = CHECKPOINTS(
        None, "save checkpoints here, and resume from the newest one found here", shown="no checkpoints",
        metavar="DIR")
    checkpoint_every_secs: float = CHECKPOINTS(60.0, "save every S seconds", metavar="S")
    checkpoint_every_steps: int | None = CHECKPOINTS(None, "also save every N global steps", shown="off",
                                                     metavar="N")
    keep_checkpoints: int = CHECKPOINTS(3, "keep the newest K checkpoints", metavar="K")
    fresh: bool = CHECKPOINTS(False, "start from scratch; earlier checkpoints move to a superseded-* folder")

    eval_every: int | None = OUTPUT(
        None, "evaluate rank 0's parameters on the test set every N global steps (summary: eval_history)",
        shown="at the end only", metavar="N")
    eval_at_end: bool = OUTPUT(
        False, "with --eval-every: copy rank 0's parameters at each such step and evaluate the copies after training, "
        "so that evaluating takes nothing from training (time to accuracy; one copy per evaluation in rank 0's memory)")
    log_dir: str | None = OUTPUT(None, "write events.jsonl and TensorBoard event files here (rank 0)",
                                 shown="no log", metavar="DIR")
    log_every: int = OUTPUT(10, "log the training scalars every N global steps", metavar="N")
    progress: bool = OUTPUT(True, "draw a progress bar on rank 0's stderr")
    summary_json: str | None = OUTPUT(None, "write the run's summary here as JSON", shown="none", metavar="PATH")
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
        from mpitrain.optim import REGISTRY

        return REGISTRY[self.optimizer].default_lr

    @property
    def wire_dtype(self):
        """Element type of parameters and gradients on the wire (updates are always float32)."""
        from mpitrain.codec import WIRE_DTYPES

        return WIRE_DTYPES[self.compress]

    def overlaps(self, workers: int) -> bool:
        """Async with this many workers: --overlap as given, else on up to AUTO_OVERLAP_MAX_WORKERS.
        --max-staleness works by holding back replies, which only binds a worker that waits for its
        reply before computing: it implies --no-overlap."""
        if self.max_staleness is not None or self.ps_transport == "shm" or self.local_steps > 1:
            return False  # shm: no round trip to hide; --local-steps: a worker's next H steps start from the reply
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
    def outer_rule(self) -> str:
        """--outer-optimizer, or its default in this mode (DEFAULT_OUTER_OPTIMIZER)."""
        return self.outer_optimizer or DEFAULT_OUTER_OPTIMIZER[self.mode]

    @property
    def epochs_or_default(self) -> int | None:
        """--epochs if given; the default only when no --steps budget was given either."""
        if self.epochs is not None:
            return self.epochs
        return None if self.steps is not None else DEFAULT_EPOCHS


def defaults() -> TrainConfig:
    return TrainConfig()


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of: {', '.join(allowed)}")


def can_take_joiners(cfg: TrainConfig) -> bool:
    """Whether a job with these flags lets workers join it (join.py) where its MPI can: it has
    --checkpoint-dir, where a joiner finds it, and heartbeats, which tell its workers to make room."""
    return bool(cfg.checkpoint_dir) and cfg.worker_timeout > 0


def _not_with(what: str, *pairs: tuple[object, str]) -> None:
    """One line for the first flag given (a pair's first item) that `what` does not work with yet."""
    for given, flag in pairs:
        if given:
            raise UsageError(f"{what} does not go with {flag} yet; drop one of the two")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UsageError naming the problem and the fix; return cfg unchanged when it is fine.

    Only checks that need no file system or MPI live here, so every rank reaches the same verdict.
    """
    _choice("mode", cfg.mode, MODES)
    _choice("on_lost_server", cfg.on_lost_server, LOST_SERVER_CHOICES)
    if cfg.join and not cfg.checkpoint_dir:
        raise UsageError("--join finds the running job through its folder: give the job's --checkpoint-dir too")
    for flag, what in (("respawn", "the most lost workers to replace, e.g. 3"), ("spares", "how many ranks wait, e.g. 1")):
        if getattr(cfg, flag) < 0:
            raise UsageError(f"--{flag} must be zero (none) or {what} (got {getattr(cfg, flag)})")
    if cfg.respawn and not isinstance(cfg.model, str):
        raise UsageError("respawn starts a worker as `python -m mpitrain` with the job's flags, which cannot carry a "
                         "Python model object; use a built-in --model, or respawn=0")
    for flag in ("respawn", "spares"):  # both let a worker in in place of a lost one (join.py)
        if getattr(cfg, flag) and not can_take_joiners(cfg):
            raise UsageError(f"--{flag} lets a worker in through the job's folder and heartbeats: give "
                             "--checkpoint-dir DIR and a --worker-timeout above 0 too")
        if getattr(cfg, flag) and cfg.on_lost_worker == "stop":
            raise UsageError(f"--{flag} replaces a lost worker, but --on-lost-worker stop ends the job when one is "
                             "lost; drop one of the two")
    if isinstance(cfg.model, str):  # else a Model object of the user's (the API checked its members)
        _choice("model", cfg.model, model_names())
    _choice("optimizer", cfg.optimizer, optimizer_names())
    prefix = next((p for p in DATASET_PREFIXES if cfg.dataset.startswith(p)), None)
    if prefix is None and cfg.dataset.endswith(".npz"):
        raise UsageError(f"--dataset {cfg.dataset}: a file of your own arrays is named with npz:, as in "
                         f"--dataset {NPZ_PREFIX}{cfg.dataset}")
    if prefix is None:
        _choice("dataset", cfg.dataset, DATASETS + tuple(p + arg for p, (arg, _, _) in DATASET_PREFIXES.items()))
    elif cfg.dataset == prefix:
        _, what, example = DATASET_PREFIXES[prefix]
        raise UsageError(f"--dataset {prefix} needs {what} after the colon, e.g. --dataset {example}")
    if (cfg.train_split, cfg.test_split) != ("train", "test") and prefix != TFDS_PREFIX:
        raise UsageError("--train-split/--test-split name tensorflow-datasets splits: use them with --dataset tfds:NAME")
    _choice("device", cfg.device, DEVICES)
    _choice("compress", cfg.compress, codec_names())
    _choice("ps_device", cfg.ps_device, PS_DEVICES)
    if cfg.ps_device == "gpu" and cfg.mode != "async":
        raise UsageError("--ps-device gpu applies to --mode async (in sync mode the workers apply the updates "
                         "on their own devices); drop it")
    _choice("wait", cfg.wait, WAITS)
    if cfg.outer_optimizer is not None:
        _choice("outer_optimizer", cfg.outer_optimizer, OUTER_OPTIMIZERS)
    if cfg.lr_scaling is not None:
        _choice("lr_scaling", cfg.lr_scaling, LR_SCALINGS)
        if cfg.lr_scaling == "linear" and cfg.mode != "sync":
            raise UsageError("--lr-scaling linear applies to --mode sync (an async update is one worker's gradient); "
                             "drop it, or use --mode sync")
    if not 0 <= cfg.warmup_epochs < float("inf"):
        raise UsageError(f"--warmup-epochs must be zero or more (got {cfg.warmup_epochs}); e.g. --warmup-epochs 1")
    if not (cfg.worker_timeout >= 0 and cfg.worker_timeout < float("inf")):
        raise UsageError(f"--worker-timeout must be zero (never) or a positive number of seconds "
                         f"(got {cfg.worker_timeout}); e.g. --worker-timeout 30")
    if cfg.num_ps < 1:
        raise UsageError(f"--num-ps must be at least 1 (got {cfg.num_ps}); e.g. --num-ps 2 (ranks 0 and 1 serve)")
    if cfg.batch_size <= 0:
        raise UsageError(f"--batch-size must be a positive integer (got {cfg.batch_size}); e.g. --batch-size 100")
    if cfg.lr is not None and not cfg.lr > 0:
        raise UsageError(f"--lr must be positive (got {cfg.lr}); e.g. --lr 0.1, or leave it out for "
                         f"{cfg.optimizer}'s default")
    if not 0 < cfg.lr_decay <= 1:
        raise UsageError(f"--lr-decay must be in (0, 1] (got {cfg.lr_decay}); 1 turns decay off")
    if not 0 <= cfg.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1) (got {cfg.momentum}); e.g. --momentum 0.9")
    if cfg.ema_decay is not None and not 0 < cfg.ema_decay < 1:
        raise UsageError(f"--ema-decay must be in (0, 1) (got {cfg.ema_decay}); the seeds used 0.99")
    if not (cfg.divergence_factor == 0 or 1 < cfg.divergence_factor < float("inf")):
        raise UsageError(f"--divergence-factor must be above 1, or 0 to turn the check off "
                         f"(got {cfg.divergence_factor}); e.g. --divergence-factor 100")
    if cfg.l2 < 0:
        raise UsageError(f"--l2 must be zero or positive (got {cfg.l2}); e.g. --l2 1e-4")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise UsageError(f"--epochs must be a positive integer (got {cfg.epochs}); e.g. --epochs 10")
    if cfg.steps is not None and cfg.steps <= 0:
        raise UsageError(f"--steps must be a positive integer (got {cfg.steps}); e.g. --steps 500")
    if cfg.seed < 0:  # NumPy's generators take no negative seed (a traceback on rank 0, the others waiting)
        raise UsageError(f"--seed must be zero or more (got {cfg.seed}); e.g. --seed 1")
    if cfg.model == "mlp" and (not cfg.hidden or any(h <= 0 for h in cfg.hidden)):
        raise UsageError(f"--hidden needs positive layer widths (got {cfg.hidden}); e.g. --hidden 100 or --hidden 256,128")
    if cfg.synthetic_samples < 2:
        raise UsageError(f"--synthetic-samples must be at least 2 (got {cfg.synthetic_samples})")
    if cfg.synthetic_features <= 0:
        raise UsageError(f"--synthetic-features must be positive (got {cfg.synthetic_features})")
    if cfg.quorum is not None:
        if cfg.mode != "sync":
            raise UsageError("--quorum applies to --mode sync; async never waits for a slow worker "
                             "(bound its staleness with --max-staleness)")
        if cfg.quorum < 1:
            raise UsageError(f"--quorum must be at least 1 (got {cfg.quorum}); e.g. --quorum 2")
    if cfg.max_staleness is not None:
        if cfg.mode != "async":
            raise UsageError("--max-staleness applies to --mode async; in sync mode every gradient is fresh")
        if cfg.max_staleness < 0:
            raise UsageError(f"--max-staleness must be zero or more (got {cfg.max_staleness})")
    if cfg.staleness_lr and cfg.mode != "async":
        raise UsageError("--staleness-lr applies to --mode async (sync gradients are never stale)")
    if cfg.staleness_lr is not None and not 0 <= cfg.staleness_lr < float("inf"):
        raise UsageError(f"--staleness-lr takes a K of zero (off) or more (got {cfg.staleness_lr}); "
                         f"e.g. --staleness-lr {DEFAULT_STALENESS_TOLERANCE:g}")
    if cfg.local_steps < 1:
        raise UsageError(f"--local-steps must be at least 1 (got {cfg.local_steps}); e.g. --local-steps 16")
    if cfg.local_steps > 1 and cfg.mode == "async":
        _not_with("--local-steps in async mode", (cfg.overlap, "--overlap"),
                  (cfg.delay_compensation is not None, "--delay-compensation"))
    if cfg.local_steps == 1 and (cfg.outer_optimizer is not None or cfg.outer_lr is not None):
        raise UsageError("--outer-optimizer and --outer-lr apply with --local-steps H above 1; "
                         "e.g. --local-steps 16 --outer-optimizer sgd")
    if cfg.outer_lr is not None and not 0 < cfg.outer_lr < float("inf"):
        raise UsageError(f"--outer-lr must be positive (got {cfg.outer_lr})")
    if cfg.outer_optimizer == "delayed-nesterov" and cfg.mode != "async":
        raise UsageError("--outer-optimizer delayed-nesterov is async's (pushes one by one); sync's outer step "
                         "averages every worker: use nesterov")
    if not 0 <= cfg.outer_momentum < 1:
        raise UsageError(f"--outer-momentum must be in [0, 1) (got {cfg.outer_momentum})")
    if cfg.ps_transport == "shm":  # as far as it goes so far (docs/modes.md, "One host")
        _not_with("--ps-transport shm", (cfg.mode != "async", "--mode sync (its Allreduce has no server)"),
                  (cfg.overlap, "--overlap"), (cfg.ps_device == "gpu", "--ps-device gpu"))
    if cfg.on_lost_server == "continue":
        if cfg.worker_timeout <= 0:
            raise UsageError("--on-lost-server continue needs heartbeats to tell a lost rank 0: give a "
                             "--worker-timeout above 0 (e.g. 3)")
    if cfg.delay_compensation is not None:
        if cfg.mode != "async":
            raise UsageError("--delay-compensation applies to --mode async (sync gradients are never stale)")
        if not 0 <= cfg.delay_compensation < float("inf"):
            raise UsageError(f"--delay-compensation takes a lambda of zero or more (got {cfg.delay_compensation}); "
                             f"e.g. --delay-compensation {DEFAULT_DC_LAMBDA:g}")
    if not (cfg.straggler_report == 0 or 1 < cfg.straggler_report < float("inf")):
        raise UsageError(f"--straggler-report must be above 1, or 0 to name no slow worker "
                         f"(got {cfg.straggler_report}); e.g. --straggler-report 1.5")
    if not 0 <= cfg.stall_warning < float("inf"):
        raise UsageError(f"--stall-warning must be zero (never) or a positive number of seconds "
                         f"(got {cfg.stall_warning}); e.g. --stall-warning 60")
    if cfg.timeline_steps <= 0:
        raise UsageError(f"--timeline-steps must be a positive number of steps (got {cfg.timeline_steps}); "
                         f"e.g. --timeline-steps 100")
    for flag, n in (("log-every", cfg.log_every), ("eval-every", cfg.eval_every),
                    ("checkpoint-every-steps", cfg.checkpoint_every_steps)):
        if n is not None and n <= 0:
            raise UsageError(f"--{flag} must be a positive number of global steps (got {n})")
    if cfg.eval_at_end and cfg.eval_every is None:
        raise UsageError("--eval-at-end evaluates what --eval-every copies: give --eval-every N too")
    if cfg.checkpoint_every_secs <= 0:
        raise UsageError(f"--checkpoint-every-secs must be positive (got {cfg.checkpoint_every_secs}); e.g. 60")
    if cfg.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1 (got {cfg.keep_checkpoints})")
    if cfg.cuda_aware and cfg.device == "cpu":
        raise UsageError("--cuda-aware hands GPU buffers to MPI and needs --device gpu (or auto), not cpu")
    if cfg.cuda_aware and cfg.compress != "none" and cfg.mode == "sync":
        raise UsageError(f"--compress {cfg.compress} in sync mode sums on the host and cannot use --cuda-aware; "
                         "drop one of the two")
    if cfg.data_dir is not None and (cfg.dataset in ("digits", "synthetic") or prefix == NPZ_PREFIX):
        raise UsageError(f"--data-dir is only read for mnist/fashion_mnist and tfds:NAME, not {cfg.dataset}; "
                         f"drop it or pick --dataset mnist")
    return cfg
