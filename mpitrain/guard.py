"""--divergence-factor: stop a run whose loss explodes while staying finite.

A non-finite loss already stops training (worker.Divergence). A learning rate far too large can
instead keep the loss finite but huge (measured: --lr 1e6 ends at test loss ~1.5e6, chance accuracy,
and used to exit 0). The guard compares a smoothed training loss with the loss the run started
from; past the factor the run stops exactly as on a NaN: every rank, exit 4, the last good
checkpoint kept.
"""

from __future__ import annotations

import math

# Weight of the newest loss in the moving average: ~10 steps of memory, so one bad minibatch does
# not stop a run, while a real explosion (losses 1e3-1e6 times the start within a few steps)
# crosses any sensible factor in one or two steps.
SMOOTHING = 0.1
NON_FINITE = "is not finite"  # the other reason a run diverges (worker.Divergence)


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
