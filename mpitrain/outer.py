"""--local-steps H, sync: local SGD (Lin et al. 2020) and DiLoCo (Douillard et al. 2023). Each worker
takes H steps of --optimizer on its own batches (its optimizer state stays its own); then the
workers average how far they moved, the outer gradient anchor - local (one Allreduce every H steps,
instead of every step), and every worker applies the same outer step to the anchor, the global
model they all started the H steps from. Outer sgd with lr 1 is plain model averaging; DiLoCo's
is Nesterov momentum (lr 0.7, momentum 0.9). Replicas are identical after each outer step, so a
checkpoint is taken there (the anchor, and the outer momentum as the optimizer state OUTER_STATE)."""

from __future__ import annotations

import numpy as np

OUTER_STATE = "outer_v"  # the outer Nesterov momentum, as checkpoints and the start-up broadcast name it
# Each --outer-optimizer's state arrays (checkpoint.state_arrays sends and saves them).
OUTER_STATES = {"sgd": (), "nesterov": (OUTER_STATE,)}


class OuterOptimizer:
    """sgd: anchor -= lr * delta; nesterov (Sutskever et al. 2013, as torch.optim.SGD(nesterov=True)):
    v = mu * v + delta, anchor -= lr * (delta + mu * v)."""

    def __init__(self, kind: str, lr: float, momentum: float, n: int, xp=np, saved=None):
        self.lr, self.mu, self.xp = lr, momentum, xp
        self.v = xp.zeros(n, xp.float32) if OUTER_STATE in OUTER_STATES[kind] else None
        if self.v is not None and saved is not None:
            self.v[...] = xp.asarray(saved)
        self.tmp = xp.empty(n, xp.float32)

    def step(self, anchor, delta) -> None:
        xp, f32, tmp = self.xp, self.xp.float32, self.tmp
        if self.v is None:
            xp.multiply(delta, f32(self.lr), out=tmp)
        else:
            self.v *= f32(self.mu)
            self.v += delta
            xp.multiply(self.v, f32(self.mu), out=tmp)
            tmp += delta
            tmp *= f32(self.lr)
        anchor -= tmp

    def state(self) -> dict:
        return {} if self.v is None else {OUTER_STATE: self.v}


class LocalSteps:
    """A sync worker's schedule with --local-steps H: which steps end with an outer step, the anchor,
    the outer optimizer, and the inner losses behind the next outer step's mean loss."""

    def __init__(self, cfg, params, xp, saved_outer=None):
        self.h = cfg.local_steps
        self.anchor = params.copy()
        self.outer = OuterOptimizer(cfg.outer_optimizer, cfg.outer_learning_rate, cfg.outer_momentum,
                                    params.shape[0], xp, saved_outer)
        self.losses: list[float] = []

    def due(self, step: int, last: bool) -> bool:
        """Whether update `step` (making global step step + 1) ends with an outer step: every H
        global steps, and at the budget's end, so that a run always ends on the global model."""
        return (step + 1) % self.h == 0 or last

    def crossed(self, step: int, every: int) -> bool:
        """Whether the H steps ending at global step `step` crossed a multiple of `every`
        (--eval-every, --checkpoint-every-steps: done at the outer step after it)."""
        return bool(every) and step // every > (step - self.h) // every
