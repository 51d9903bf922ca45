"""TrainConfig: every training option, its default, and the checks on it.

This module is the one place that holds defaults; cli.py builds its parser from them.
It imports nothing heavy, so `--help` and bad flags answer fast, and NumPy loads only after cli.py
has pinned the BLAS threads (a test holds it to that).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MODES = ("async", "sync")

DATASETS = ("digits", "mnist", "fashion_mnist", "synthetic")
NPZ_PREFIX, TFDS_PREFIX = "npz:", "tfds:"  # --dataset npz:PATH (your own arrays), tfds:NAME (any tfds image classifier)
DATASET_PREFIXES = {NPZ_PREFIX: ("PATH", "a file", "npz:mydata.npz"), TFDS_PREFIX: ("NAME", "a dataset name", "tfds:kmnist")}
DEVICES = ("auto", "cpu", "gpu")
COMPRESSIONS = ("none", "fp16", "bf16")  # codec.WIRE_DTYPES has their element types
WAITS = ("auto", "spin", "yield")
LR_SCALINGS = ("linear", "none")


def model_names() -> tuple[str, ...]:
    """--model's choices: model.py's registry. Imported when called, not above: NumPy must not load
    before cli.py pins the BLAS threads."""
    from mpitrain.model import HIDDEN

    return tuple(HIDDEN)


def optimizer_names() -> tuple[str, ...]:
    """--optimizer's choices: optim.py's registry (imported when called, as model_names)."""
    from mpitrain.optim import REGISTRY

    return tuple(REGISTRY)


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
# Seconds without a global step before the waiting rank says what it waits for (Horovod's stall
# inspector warns after 60 s too).
DEFAULT_STALL_WARNING_S = 60.0
# --timeline keeps every span of each rank's first N steps and about its last N.
DEFAULT_TIMELINE_STEPS = 100


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, on every rank."""


@dataclass(frozen=True)
class TrainConfig:
    # parallelism
    mode: str = "async"
    num_ps: int = 1  # parameter servers: ranks 0..num_ps-1, each serving one shard of the parameters
    overlap: bool = True
    compress: str = "none"
    quorum: int | None = None  # sync: gradients averaged per update (None: every worker)
    max_staleness: int | None = None  # async: bound on the staleness of every applied gradient
    staleness_lr: bool = False
    stragglers: tuple[tuple[int, str, float], ...] = ()  # (rank, "delay"|"factor", value)
    wait: str = "auto"
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT_S  # 0: never declare a rank lost
    # model
    model: str = "mlp"
    hidden: tuple[int, ...] = (100,)
    l2: float = 0.0
    # optimisation
    optimizer: str = "sgd"  # the seeds' GradientDescentOptimizer; momentum + async staleness is fragile
    lr: float = 0.1
    lr_decay: float = 0.99
    lr_scaling: str | None = None  # None: "linear" in sync, "none" in async (see scaled_lr)
    warmup_epochs: float = DEFAULT_WARMUP_EPOCHS
    momentum: float = 0.9
    ema_decay: float | None = None
    batch_size: int = 100
    epochs: int | None = None
    steps: int | None = None
    seed: int = 0
    divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR  # 0: only non-finite losses stop a run
    # data
    dataset: str = "digits"
    data_dir: str | None = None
    train_split: str = "train"  # tfds:NAME only
    test_split: str = "test"
    synthetic_samples: int = 12000
    synthetic_features: int = 784
    # device
    device: str = "auto"
    cuda_aware: bool = False
    # checkpoints
    checkpoint_dir: str | None = None
    checkpoint_every_secs: float = 60.0
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 3
    fresh: bool = False
    # output
    eval_every: int | None = None
    log_dir: str | None = None
    log_every: int = 10
    progress: bool = True
    summary_json: str | None = None
    straggler_report: float = DEFAULT_STRAGGLER_REPORT  # 0: name nobody
    stall_warning: float = DEFAULT_STALL_WARNING_S  # 0: never
    timeline: str | None = None
    timeline_steps: int = DEFAULT_TIMELINE_STEPS

    @property
    def wire_dtype(self):
        """Element type of parameters and gradients on the wire (updates are always float32)."""
        from mpitrain.codec import WIRE_DTYPES

        return WIRE_DTYPES[self.compress]

    @property
    def effective_overlap(self) -> bool:
        """--max-staleness works by holding back replies, which only binds a worker that waits
        for its reply before computing: it implies --no-overlap."""
        return self.overlap and self.max_staleness is None

    @property
    def scaled_lr(self) -> bool:
        """Sync updates average the gradients of several workers' batches: as Horovod and Goyal et
        al. (2017), the learning rate grows with them. Async applies each gradient alone."""
        return (self.lr_scaling or ("linear" if self.mode == "sync" else "none")) == "linear"

    @property
    def epochs_or_default(self) -> int | None:
        """--epochs if given; the default only when no --steps budget was given either."""
        if self.epochs is not None:
            return self.epochs
        return None if self.steps is not None else DEFAULT_EPOCHS


# What a rank may set for itself: where it reads or writes on its own host, what it shows, how it
# computes and waits, and what rank 0 alone decides or writes. Every other field must be the same
# on every rank, or messages and collectives would not match (a worker without --ema-decay, or
# with another --steps, would send rank 0 something else than it expects, or stop at another
# step): trainer.agree_on_setup refuses the run in one line. A new field is agreed unless listed.
PER_RANK_FIELDS = frozenset({
    "data_dir", "device", "cuda_aware", "wait",  # this host's files and hardware
    "progress", "summary_json", "log_dir", "timeline", "timeline_steps",  # output (rank 0's, or this rank's spans)
    "straggler_report", "stall_warning",  # rank 0's reporting
    "fresh", "keep_checkpoints",  # rank 0 writes the checkpoints
})


def agreed_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainConfig) if f.name not in PER_RANK_FIELDS)


def parse_straggler(text: str) -> tuple[int, str, float]:
    """RANK:SECONDS (added to every step) or RANK:xFACTOR (every step takes FACTOR times as long)."""
    rank_s, sep, amount = text.partition(":")
    try:
        if not sep:
            raise ValueError
        rank = int(rank_s)
        if amount.lower().startswith("x"):
            kind, value = "factor", float(amount[1:])
        else:
            kind, value = "delay", float(amount)
    except ValueError:
        raise UsageError(f"--straggler takes RANK:SECONDS or RANK:xFACTOR, e.g. 3:0.01 or 3:x5, not {text!r}") from None
    if rank < 1:
        raise UsageError(f"--straggler {text}: rank {rank} is the parameter server (or invalid); name a worker rank >= 1")
    if kind == "delay" and not value >= 0:
        raise UsageError(f"--straggler {text}: the delay must be zero or more seconds")
    if kind == "factor" and not value >= 1:
        raise UsageError(f"--straggler {text}: the factor must be at least 1 (x5 makes each step 5 times as long)")
    return rank, kind, value


def defaults() -> TrainConfig:
    return TrainConfig()


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of: {', '.join(allowed)}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UsageError naming the problem and the fix; return cfg unchanged when it is fine.

    Only checks that need no file system or MPI live here, so every rank reaches the same verdict.
    """
    _choice("mode", cfg.mode, MODES)
    _choice("model", cfg.model, model_names())
    _choice("optimizer", cfg.optimizer, optimizer_names())
    prefix = next((p for p in DATASET_PREFIXES if cfg.dataset.startswith(p)), None)
    if prefix is None:
        _choice("dataset", cfg.dataset, DATASETS + tuple(p + arg for p, (arg, _, _) in DATASET_PREFIXES.items()))
    elif cfg.dataset == prefix:
        _, what, example = DATASET_PREFIXES[prefix]
        raise UsageError(f"--dataset {prefix} needs {what} after the colon, e.g. --dataset {example}")
    if (cfg.train_split, cfg.test_split) != ("train", "test") and prefix != TFDS_PREFIX:
        raise UsageError("--train-split/--test-split name tensorflow-datasets splits: use them with --dataset tfds:NAME")
    _choice("device", cfg.device, DEVICES)
    _choice("compress", cfg.compress, COMPRESSIONS)
    _choice("wait", cfg.wait, WAITS)
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
    if not cfg.lr > 0:
        raise UsageError(f"--lr must be positive (got {cfg.lr}); e.g. --lr 0.1")
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
    if cfg.log_every <= 0:
        raise UsageError(f"--log-every must be a positive number of global steps (got {cfg.log_every})")
    if not (cfg.straggler_report == 0 or 1 < cfg.straggler_report < float("inf")):
        raise UsageError(f"--straggler-report must be above 1, or 0 to name no slow worker "
                         f"(got {cfg.straggler_report}); e.g. --straggler-report 1.5")
    if not 0 <= cfg.stall_warning < float("inf"):
        raise UsageError(f"--stall-warning must be zero (never) or a positive number of seconds "
                         f"(got {cfg.stall_warning}); e.g. --stall-warning 60")
    if cfg.timeline_steps <= 0:
        raise UsageError(f"--timeline-steps must be a positive number of steps (got {cfg.timeline_steps}); "
                         f"e.g. --timeline-steps 100")
    if cfg.eval_every is not None and cfg.eval_every <= 0:
        raise UsageError(f"--eval-every must be a positive number of global steps (got {cfg.eval_every})")
    if cfg.checkpoint_every_secs <= 0:
        raise UsageError(f"--checkpoint-every-secs must be positive (got {cfg.checkpoint_every_secs}); e.g. 60")
    if cfg.checkpoint_every_steps is not None and cfg.checkpoint_every_steps <= 0:
        raise UsageError(f"--checkpoint-every-steps must be a positive number of global steps "
                         f"(got {cfg.checkpoint_every_steps})")
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


def validate_for_world(cfg: TrainConfig, size: int) -> None:
    """The checks that need the world size (known on every rank, identically)."""
    from mpitrain.layout import Layout

    K = cfg.num_ps
    if K > 1 and K >= size:
        here = "one process trains locally with no server" if size == 1 else f"{size} ranks leave no worker"
        raise UsageError(f"--num-ps {K} needs at least {K + 1} ranks ({K} servers and a worker), and {here}; "
                         f"use mpirun -np {K + 1} or more, or a smaller --num-ps")
    layout = Layout(size, K)
    workers = layout.workers
    servers = "rank 0 is the parameter server" if K == 1 else f"ranks 0..{K - 1} are the parameter servers"
    for rank, _, _ in cfg.stragglers:
        if rank >= size or layout.is_server(rank):
            where = f"ranks here are 0..{size - 1}" if rank >= size else f"it is a server (--num-ps {K})"
            raise UsageError(f"--straggler names rank {rank}, but {where} ({servers}); name a worker rank "
                             f"{layout.worker_ranks[0]}..{layout.worker_ranks[-1]}")
    if cfg.quorum is not None and cfg.quorum > workers:
        raise UsageError(f"--quorum {cfg.quorum} is more than the {workers} worker(s); use 1..{workers}")
    if cfg.max_staleness is not None and size > 1 and cfg.max_staleness < workers - 1:
        raise UsageError(f"--max-staleness {cfg.max_staleness} cannot hold with {workers} workers: when all "
                         f"compute on the same parameters one of them is {workers - 1} updates stale; "
                         f"use {workers - 1} or more")
