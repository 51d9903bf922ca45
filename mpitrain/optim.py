"""Optimizers on flat parameter vectors, and the learning-rate schedule.

Each optimizer updates `params` in place from a flat gradient of the same layout; its state
(velocity, Adam moments) is flat too, so it can be saved, sent or compared as one array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class OptimizerKind:
    """One entry of the registry: the names of its flat state arrays (each as long as the
    parameters; checkpoints, the start-up broadcast and the sync coordinator's hand-over to rank 0 take
    them from here) and its update, step(opt, params, grad, lr), which uses `opt.state[name]`."""

    state: tuple[str, ...]
    step: Callable
    default_lr: float  # used when --lr is not given


def _sgd(opt: "Optimizer", params, grad, lr: float) -> None:
    xp, tmp = opt.xp, opt.tmp
    xp.multiply(grad, xp.float32(lr), out=tmp)
    params -= tmp


def _momentum(opt: "Optimizer", params, grad, lr: float) -> None:
    xp, tmp, m = opt.xp, opt.tmp, opt.state["m"]
    m *= xp.float32(opt.momentum)
    m += grad
    xp.multiply(m, xp.float32(lr), out=tmp)
    params -= tmp


def _adam(opt: "Optimizer", params, grad, lr: float) -> None:
    xp, tmp, m, v = opt.xp, opt.tmp, opt.state["m"], opt.state["v"]
    b1, b2, t = opt.beta1, opt.beta2, opt.t
    m *= xp.float32(b1)
    xp.multiply(grad, xp.float32(1 - b1), out=tmp)
    m += tmp
    v *= xp.float32(b2)
    xp.multiply(grad, grad, out=tmp)
    tmp *= xp.float32(1 - b2)
    v += tmp
    # params -= lr_t * m / (sqrt(v) + eps_t), bias corrections folded into lr_t, eps_t
    lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    eps_t = opt.eps * np.sqrt(1 - b2 ** t)
    xp.sqrt(v, out=tmp)
    tmp += xp.float32(eps_t)
    xp.divide(m, tmp, out=tmp)
    tmp *= xp.float32(lr_t)
    params -= tmp


# --optimizer NAME -> its kind. Adding an optimizer is one function and one line here (the CLI's
# choices, checkpoints and resume follow); README, Architecture.
# The default learning rates, measured on digits (50 epochs; docs/optimizers.md): sgd 0.1 is the
# seeds'; momentum 0.1 (an effective 1.0 at 0.9) diverges in async mode (7% accuracy), 0.01 as
# Keras's SGD trains everywhere; adam 1e-3 is Kingma & Ba's, Keras's and PyTorch's.
REGISTRY: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind((), _sgd, 0.1),
    "momentum": OptimizerKind(("m",), _momentum, 0.01),  # heavy ball, as tf.train.MomentumOptimizer
    "adam": OptimizerKind(("m", "v"), _adam, 1e-3),  # Kingma & Ba
}


class Optimizer:
    """One of the REGISTRY's optimizers with its state, on NumPy or CuPy (`xp`)."""

    def __init__(self, kind: str, n: int, xp=np, momentum: float = 0.9,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        if kind not in REGISTRY:
            raise ValueError(f"unknown optimizer {kind!r}")
        self.kind = kind
        self.xp = xp
        self.momentum = momentum
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.t = 0  # updates applied (Adam's bias correction needs it)
        self.state = {name: xp.zeros(n, xp.float32) for name in REGISTRY[kind].state}
        self.tmp = xp.empty(n, xp.float32)

    def restore(self, t: int, saved: dict) -> None:
        """Continue from a checkpoint's state arrays (host arrays, by state name)."""
        self.t = t
        for name, mine in self.state.items():
            if saved.get(name) is not None:
                mine[...] = self.xp.asarray(saved[name])

    def step(self, params, grad, lr: float) -> None:
        self.t += 1
        REGISTRY[self.kind].step(self, params, grad, lr)


def decayed_lr(lr: float, decay: float, samples_seen: int, n_train: int) -> float:
    """tf.train.exponential_decay (staircase=False) with one decay period = one epoch of
    global data: lr * decay ** (samples_seen / n_train)."""
    return lr * decay ** (samples_seen / n_train)


def staleness_scaled_lr(lr: float, staleness: int) -> float:
    """--staleness-lr (Zhang et al. 2016, "Staleness-aware async-SGD"): divide the step of a
    gradient computed on parameters `staleness` updates old by that staleness."""
    return lr / max(1, staleness)


class WeightEMA:
    """--ema-decay: a moving average of the parameters, as tf.train.ExponentialMovingAverage with
    num_updates: the decay is min(decay, (1 + t) / (10 + t)), so early averages are not dominated
    by the initial weights. Starts equal to the parameters."""

    def __init__(self, decay: float, params, xp=np, t: int = 0):
        self.decay, self.xp, self.t = decay, xp, t
        self.avg = params.copy()
        self._tmp = xp.empty_like(self.avg)

    def update(self, params) -> None:
        xp = self.xp
        d = min(self.decay, (1 + self.t) / (10 + self.t))
        self.t += 1
        self.avg *= xp.float32(d)
        xp.multiply(params, xp.float32(1 - d), out=self._tmp)
        self.avg += self._tmp


def make_ema(decay: float | None, params, xp=np, t: int = 0, saved=None) -> WeightEMA | None:
    """The moving average for --ema-decay (None when off), continued from a checkpoint's `saved`."""
    if not decay:
        return None
    ema = WeightEMA(decay, params, xp, t)
    if saved is not None:
        ema.avg[...] = xp.asarray(saved)
    return ema


class ServerUpdate:
    """The async server's update rule over its slice of the parameters: one gradient, one step of
    --optimizer at the step's learning rate (divided by the gradient's staleness with
    --staleness-lr), then the moving average (--ema-decay). Whatever carries the gradient here (a
    message loop, a store that workers write) calls `apply`; another rule (delay compensation, an
    outer optimizer) is another class with the same method and state."""

    def __init__(self, cfg, params, xp, start_step: int, opt_t: int, opt_state: dict, saved_ema=None):
        self.params, self.staleness_lr = params, cfg.staleness_lr
        self.opt = Optimizer(cfg.optimizer, params.shape[0], xp, momentum=cfg.momentum)
        self.opt.restore(opt_t, opt_state)
        self.ema = make_ema(cfg.ema_decay, params, xp, start_step, saved_ema)

    def apply(self, grad, lr: float, staleness: int) -> None:
        if self.staleness_lr:
            lr = staleness_scaled_lr(lr, staleness)
        self.opt.step(self.params, grad, lr)
        if self.ema:
            self.ema.update(self.params)
