"""TrainConfig: every training option, its default, and the checks on it.

This module is the one place that holds defaults; cli.py builds its parser from them.
It imports nothing heavy, so `--help` and bad flags answer fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MODES = ("async", "sync")
MODELS = ("softmax", "mlp")
OPTIMIZERS = ("sgd", "momentum", "adam")
DATASETS = ("digits", "mnist", "fashion_mnist", "synthetic")
DEVICES = ("auto", "cpu", "gpu")
COMPRESSIONS = ("none", "fp16")

# Used when neither --epochs nor --steps is given: enough for digits to pass 93%.
DEFAULT_EPOCHS = 30


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, on every rank."""


@dataclass(frozen=True)
class TrainConfig:
    # parallelism
    mode: str = "async"
    overlap: bool = True
    compress: str = "none"
    # model
    model: str = "mlp"
    hidden: tuple[int, ...] = (100,)
    l2: float = 0.0
    # optimisation
    optimizer: str = "sgd"  # the seeds' GradientDescentOptimizer; momentum + async staleness is fragile
    lr: float = 0.3
    lr_decay: float = 0.99
    momentum: float = 0.9
    batch_size: int = 100
    epochs: int | None = None
    steps: int | None = None
    seed: int = 0
    # data
    dataset: str = "digits"
    data_dir: str | None = None
    synthetic_samples: int = 12000
    synthetic_features: int = 784
    # device
    device: str = "auto"
    # output
    progress: bool = True
    summary_json: str | None = None

    @property
    def layer_sizes_hidden(self) -> tuple[int, ...]:
        """Hidden widths actually used: softmax regression has none."""
        return () if self.model == "softmax" else self.hidden

    @property
    def wire_dtype(self):
        """Element type of parameters and gradients on the wire (updates are always float32)."""
        import numpy as np

        return np.float16 if self.compress == "fp16" else np.float32

    @property
    def epochs_or_default(self) -> int | None:
        """--epochs if given; the default only when no --steps budget was given either."""
        if self.epochs is not None:
            return self.epochs
        return None if self.steps is not None else DEFAULT_EPOCHS


def defaults() -> TrainConfig:
    return TrainConfig()


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of: {', '.join(allowed)}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UsageError naming the problem and the fix; return cfg unchanged when it is fine.

    Only checks that need no file system or MPI live here, so every rank reaches the same verdict.
    """
    _choice("mode", cfg.mode, MODES)
    _choice("model", cfg.model, MODELS)
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _choice("dataset", cfg.dataset, DATASETS)
    _choice("device", cfg.device, DEVICES)
    _choice("compress", cfg.compress, COMPRESSIONS)
    if cfg.batch_size <= 0:
        raise UsageError(f"--batch-size must be a positive integer (got {cfg.batch_size}); e.g. --batch-size 100")
    if not cfg.lr > 0:
        raise UsageError(f"--lr must be positive (got {cfg.lr}); e.g. --lr 0.3")
    if not 0 < cfg.lr_decay <= 1:
        raise UsageError(f"--lr-decay must be in (0, 1] (got {cfg.lr_decay}); 1 turns decay off")
    if not 0 <= cfg.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1) (got {cfg.momentum}); e.g. --momentum 0.9")
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
    if cfg.data_dir is not None and cfg.dataset in ("digits", "synthetic"):
        raise UsageError(f"--data-dir is only read for mnist/fashion_mnist, not {cfg.dataset}; drop it or pick --dataset mnist")
    return cfg
