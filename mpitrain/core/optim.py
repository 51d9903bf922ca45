"""Optimizers on flat parameter vectors, and the learning-rate schedule.

Each optimizer updates `params` in place from a flat gradient of the same layout; its state
(velocity, Adam moments) is flat too, so it can be saved, sent or compared as one array.
"""

from __future__ import annotations

import functools
import math
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
    # The same update with the parameters' last pass as one BLAS axpy (Optimizer(blas=True), NumPy
    # only); None: the kind has none, `step` is used.
    blas_step: Callable | None = None
    # Whether the update carries a velocity of its own (a first moment) across steps: with
    # --local-steps it compounds with the outer optimizer's momentum (config.DEFAULT_OUTER_MOMENTUM).
    own_momentum: bool = False


def _sgd(opt: "Optimizer", params, grad, lr: float) -> None:
    xp, tmp = opt.xp, opt.tmp
    xp.multiply(grad, xp.float32(lr), out=tmp)
    params -= tmp


@functools.cache
def blas_saxpy():
    """SciPy's BLAS saxpy, loaded once. SciPy takes ~0.4 s to load: a job loads it while setting up
    (`preload_blas`), or that time falls inside training's clock."""
    from scipy.linalg.blas import saxpy

    return saxpy


def preload_blas(cfg) -> None:
    """Every rank of a --ps-transport shm job, while it loads its data and before the ranks meet:
    the store's one-pass apply needs SciPy, whose ~0.4 s load once sat inside rank 0's training clock
    (2026-11-29: 0.62x of the machine for a 3,000-step MLP run instead of 0.84x, rank 0 '21% busy')."""
    if cfg.ps_transport == "shm" and REGISTRY[cfg.optimizer].blas_step is not None:
        blas_saxpy()


def axpy(opt: "Optimizer", x, y, a: float) -> None:
    """y += a * x in place, in one pass over float32 NumPy arrays: BLAS's saxpy (SciPy's, loaded
    by Optimizer(blas=True)), where NumPy's `y -= lr * x` is two passes and a temporary. A fused
    multiply-add rounds once, so the result may differ from NumPy's in the last bit: only paths with
    no digest to keep use it."""
    out = opt.saxpy(x, y, a=a)
    if out is not y:  # f2py copied y (not contiguous float32): the result went to the copy
        y[...] = out


def _sgd_blas(opt: "Optimizer", params, grad, lr: float) -> None:
    axpy(opt, grad, params, -lr)


def _momentum(opt: "Optimizer", params, grad, lr: float) -> None:
    xp, tmp, m = opt.xp, opt.tmp, opt.state["m"]
    m *= xp.float32(opt.momentum)
    m += grad
    xp.multiply(m, xp.float32(lr), out=tmp)
    params -= tmp


def _momentum_blas(opt: "Optimizer", params, grad, lr: float) -> None:
    m = opt.state["m"]
    m *= np.float32(opt.momentum)
    m += grad
    axpy(opt, m, params, -lr)


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
# choices, checkpoints and resume follow); docs/architecture.md.
# The default learning rates, measured on digits (50 epochs; docs/optimizers.md): sgd 0.1 is the
# seeds'; momentum 0.1 (an effective 1.0 at 0.9) diverges in async mode (7% accuracy), 0.01 as
# Keras's SGD trains everywhere; adam 1e-3 is Kingma & Ba's, Keras's and PyTorch's.
REGISTRY: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind((), _sgd, 0.1, _sgd_blas),
    # heavy ball, as tf.train.MomentumOptimizer
    "momentum": OptimizerKind(("m",), _momentum, 0.01, _momentum_blas, own_momentum=True),
    "adam": OptimizerKind(("m", "v"), _adam, 1e-3, own_momentum=True),  # Kingma & Ba
}


class Optimizer:
    """One of the REGISTRY's optimizers with its state, on NumPy or CuPy (`xp`)."""

    def __init__(self, kind: str, n: int, xp=np, momentum: float = 0.9,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, blas: bool = False):
        if kind not in REGISTRY:
            raise ValueError(f"unknown optimizer {kind!r}")
        self.kind = kind
        # blas: the kind's one-pass update where it has one, on NumPy (the shm store: its apply is
        # under the lock that every worker waits on)
        self._step = (REGISTRY[kind].blas_step if blas and xp is np else None) or REGISTRY[kind].step
        if self._step is REGISTRY[kind].blas_step:
            self.saxpy = blas_saxpy()
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
        self._step(self, params, grad, lr)


def decayed_lr(lr: float, decay: float, samples_seen: int, n_train: int) -> float:
    """tf.train.exponential_decay (staircase=False) with one decay period = one epoch of
    global data: lr * decay ** (samples_seen / n_train)."""
    return lr * decay ** (samples_seen / n_train)


def staleness_scaled_lr(lr: float, staleness: int, tolerance: float = 1.0) -> float:
    """--staleness-lr K: the step of a gradient computed on parameters `staleness` updates old is
    lr * min(1, K / staleness), full for gradients at most K updates old. K = 1 is Zhang et al.
    2016's "staleness-aware async-SGD" (lr / staleness)."""
    return lr * min(1.0, tolerance / max(1, staleness))


@dataclass(frozen=True)
class StalenessHold:
    """--max-staleness S as a decision without side effects: may a gradient be applied now, at
    global step g, given the bases (the steps their parameters came from) of the other workers'
    pending gradients? After it the others can at best follow oldest basis first, the k-th at step
    g+k, so it needs g + k - basis <= S for each (earliest deadline first: the oldest pending
    gradient always qualifies, so this cannot deadlock when S >= workers-1). None: unbounded.
    --local-steps H: each update is H global steps and S counts updates (outer steps), so the k-th
    follows at g + kH and needs g + kH - basis <= SH (ceil((g + kH - basis) / H) <= S)."""

    bound: int | None
    span: int = 1  # global steps per update: --local-steps H

    def allows(self, global_step: int, other_bases: list[int]) -> bool:
        if self.bound is None:
            return True
        h = self.span
        return all(global_step + k * h - b <= self.bound * h for k, b in enumerate(sorted(other_bases), start=1))


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


# DC-ASGD's adaptive variant (Zheng et al., ICML 2017, "Asynchronous Stochastic Gradient Descent with Delay
# Compensation"): the decay of the gradients' mean square, their value; the floor under its root.
DC_MEAN_SQUARE_DECAY = 0.95
DC_EPS = 1e-7


class DelayCompensation:
    """--delay-compensation LAMBDA over one server's slice: a gradient g computed on the parameters
    w_sent that were sent to its worker is applied as g + lambda_t * g * g * (w_now - w_sent), a
    first-order correction of g towards the gradient at w_now, with g * g standing for the Hessian's
    diagonal; lambda_t = LAMBDA / sqrt(mean square of g), elementwise (the paper's adaptive variant),
    the mean square bias-corrected as Adam's moments are. The parameters each worker was sent are
    kept by the version they carry (the step a worker's gradient names as its basis): with --overlap
    a gradient is computed on the parameters sent one reply earlier, so two per worker. Nothing of
    it is checkpointed: a resumed or re-formed job sends every worker the same start parameters,
    so their copies are rebuilt exactly; the mean square starts again from the next gradients."""

    KEEP = 2  # copies per worker: the newest reply and, with --overlap, the one before

    def __init__(self, lam: float, params, xp, workers: int, version: int):
        self.lam, self.params, self.xp = lam, params, xp
        start = params.copy()  # every worker starts from these (one array shared by all)
        self.sent: list[dict[int, object]] = [{version: start} for _ in range(workers)]
        self.mean_square = xp.zeros_like(params)
        self.t = 0
        self.uncompensated = 0  # gradients whose parameters were no longer known (none expected)
        # Scratch, so that the server allocates nothing per gradient; `out` is what compensated()
        # returns, valid until its next call.
        self.g2, self.tmp, self.out = (xp.empty_like(params) for _ in range(3))

    def was_sent(self, worker: int, version: int) -> None:
        """The server's parameters (now at `version`) went to this worker."""
        kept = self.sent[worker]
        kept[version] = self.params.copy()
        for old in sorted(kept)[:-self.KEEP]:
            del kept[old]

    def forget(self, worker: int) -> None:
        self.sent[worker] = {}

    def compensated(self, grad, worker: int, basis: int):
        """g + lambda_t * g * g * (w_now - w_sent), into `self.out`; `grad` is left as it was."""
        xp, f32, d = self.xp, self.xp.float32, DC_MEAN_SQUARE_DECAY
        g2, tmp, out = self.g2, self.tmp, self.out
        self.t += 1
        xp.multiply(grad, grad, out=g2)
        self.mean_square *= f32(d)
        xp.multiply(g2, f32(1 - d), out=tmp)
        self.mean_square += tmp
        then = self.sent[worker].get(basis)
        if then is None:
            self.uncompensated += 1
            return grad
        for old in [v for v in self.sent[worker] if v < basis]:  # the worker has newer ones
            del self.sent[worker][old]
        xp.sqrt(self.mean_square, out=tmp)  # the root of the bias-corrected mean square, floored
        tmp *= f32(1 / math.sqrt(1 - d ** self.t))
        tmp += f32(DC_EPS)
        xp.subtract(self.params, then, out=out)
        out *= g2
        out /= tmp
        out *= f32(self.lam)
        out += grad
        return out


class ServerUpdate:
    """The async server's update rule over its slice of the parameters: one gradient, one step of
    --optimizer at the step's learning rate (divided by the gradient's staleness with
    --staleness-lr), then the moving average (--ema-decay). Whatever carries the gradient here (a
    message loop, a store that workers write) calls `apply`; another rule (delay compensation, an
    outer optimizer) is another class with the same method and state."""

    def __init__(self, cfg, params, xp, start_step: int, opt_t: int, opt_state: dict, saved_ema=None,
                 workers: int = 0, version: int = 0, blas: bool = False):
        self.params, self.tolerance = params, cfg.staleness_tolerance
        self.opt = Optimizer(cfg.optimizer, params.shape[0], xp, momentum=cfg.momentum, blas=blas)
        self.opt.restore(opt_t, opt_state)
        self.ema = make_ema(cfg.ema_decay, params, xp, start_step, saved_ema)
        self.dc = None if cfg.delay_compensation is None else DelayCompensation(
            cfg.delay_compensation, params, xp, workers, version)

    def was_sent(self, worker: int, version: int) -> None:
        if self.dc:
            self.dc.was_sent(worker, version)

    def forget(self, worker: int) -> None:
        if self.dc:
            self.dc.forget(worker)

    def apply(self, grad, lr: float, staleness: int, worker: int = 0, basis: int = 0) -> None:
        """One gradient from `worker`, computed on the parameters of version `basis`."""
        if self.dc:
            grad = self.dc.compensated(grad, worker, basis)
        if self.tolerance:
            lr = staleness_scaled_lr(lr, staleness, self.tolerance)
        self.opt.step(self.params, grad, lr)
        if self.ema:
            self.ema.update(self.params)
