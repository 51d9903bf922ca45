"""--divergence-factor: stop a run whose loss explodes while staying finite.

A non-finite loss already stops training (gradients.Divergence). A learning rate far too large can
instead keep the loss finite but huge (measured: --lr 1e6 ends at test loss ~1.5e6, chance accuracy,
and used to exit 0). The guard compares a smoothed training loss with the loss the run started
from; past the factor the run stops exactly as on a NaN: every rank, exit 4, the last good
checkpoint kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Weight of the newest loss in the moving average: ~10 steps of memory, so one bad minibatch does
# not stop a run, while a real explosion (losses 1e3-1e6 times the start within a few steps)
# crosses any sensible factor in one or two steps.
SMOOTHING = 0.1
NON_FINITE = "is not finite"  # the other reason a run diverges (gradients.Divergence)


@dataclass
class Diverged:
    """Where and why training diverged, the one shape every rank keeps it in (a report carries it
    as a dict, the summary as its `diverged` entry). Each rank knows part of it: the async server
    all of it; in sync mode rank 0 only the step (the coordinator's flag), each worker the mean loss, why,
    and whether its own loss was the culprit (`mine`); rank 0 puts them together (trainer)."""

    global_step: int
    ranks: list[int] = field(default_factory=list)  # the workers whose loss it was; []: the mean, or not known
    loss: float = float("nan")
    why: str | None = None  # NON_FINITE or LossGuard's line; None: not known on this rank
    mine: bool = False  # a sync worker: its own loss was not finite

    @classmethod
    def from_dict(cls, d: dict | None) -> "Diverged | None":
        return None if d is None else cls(**d)

    def line(self, checkpoints: list[str]) -> str:
        """Rank 0's one line: the step, whose loss, why, the fix and the last good checkpoint."""
        who = f"worker rank {', '.join(map(str, self.ranks))}'s loss" if self.ranks else "the workers' mean loss"
        kept = f"; the last good checkpoint is {checkpoints[-1]}" if checkpoints else ""
        why = self.why or NON_FINITE
        off = "" if why == NON_FINITE else ", or --divergence-factor 0 to turn this check off"
        return (f"mpitrain: error: training diverged at global step {self.global_step}: {who} {why}; "
                f"lower --lr (or use --optimizer adam / --l2{off}){kept}")


class LossGuard:
    """Feed it every applied step's training loss, in order. The reference is the first loss it
    sees: the loss of the starting parameters (of this run, when resumed)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.start: float | None = None
        self.smoothed = 0.0

    def exploded(self, loss: float) -> str | None:
        """Why the run must stop (the end of "the loss ..."), or None. Non-finite losses are
        worker.Divergence's business."""
        if self.factor <= 0 or not math.isfinite(loss):
            return None
        if self.start is None:
            self.start = self.smoothed = loss
            return None
        self.smoothed += SMOOTHING * (loss - self.smoothed)
        if self.start > 0 and self.smoothed > self.factor * self.start:
            return (f"rose to {self.smoothed:.4g} (smoothed), over --divergence-factor {self.factor:g} "
                    f"x its start {self.start:.4g}")
        return None
