"""The data ledger: which samples each of the job's batches holds, and what each epoch saw.

Every epoch is one permutation of the training set, seeded by (--seed, epoch) and the same on every
rank, as torch's DistributedSampler; it is cut into S shards of `per_shard` samples, each read in
whole batches (`batches_per_shard` of them); S, the deal's `shards`, is the number of workers the job
first started with, and it stays the job's for its whole life (checkpoints keep it), so that a worker
lost, let in or a resume with another worker count never changes what an epoch is.

The job's batches are one numbered sequence across epochs, step-major: batch g is batch k of shard s
in epoch e, where g = e * per_epoch + k * S + s. A sync step of W workers takes the next W numbers
(worker i the i-th), so with the job's own worker count it takes batch k of every shard, as the
per-worker shards always did; after a regroup or a join the next numbers go to whoever is there, and
a step given up at a regroup deals its numbers again. Its `dealt` count, where the deal has got to, is
all the ledger a sync job needs: it is the count of worker batches in the updates applied, kept with
the global step in every state (the coordinator's status, a regroup's broadcast, a checkpoint).

Async workers read their own shard (s = the worker's index), batch after batch; rank 0 counts each
worker's applied gradients, and a worker that replaces a lost one goes on from that count. The few
samples past the last whole batch of each shard wait for a later epoch's reshuffle (`left`).

`epochs` writes the summary's account of every epoch begun. Nothing here is per sample: a deal is
four integers, and an account is a few integers per epoch and worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Deal:
    """The shape of every epoch: `n_train` samples in `shards` shards of whole batches of `batch`."""

    n_train: int
    batch: int
    shards: int
    seed: int
    _perms: dict = field(default_factory=dict, compare=False, repr=False)  # the last epochs' permutations

    @property
    def per_shard(self) -> int:
        return self.n_train // self.shards

    @property
    def batches_per_shard(self) -> int:
        return self.per_shard // self.batch

    @property
    def per_epoch(self) -> int:
        """Batches in one epoch: every shard's whole batches."""
        return self.shards * self.batches_per_shard

    @property
    def left(self) -> int:
        """Samples of each epoch in no whole batch: they wait for a later epoch's reshuffle."""
        return self.n_train - self.per_epoch * self.batch

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # a step spans at most two epochs
                self._perms.clear()
            perm = self._perms[epoch] = np.random.default_rng([self.seed, epoch, 0xDA7A]).permutation(self.n_train)
        return perm

    def locate(self, g: int) -> tuple[int, int, int]:
        """(epoch, shard, batch of the shard) of the job's batch number `g`."""
        epoch, j = divmod(g, self.per_epoch)
        k, s = divmod(j, self.shards)
        return epoch, s, k

    def place(self, g: int) -> tuple[int, int]:
        """(epoch, where batch `g` starts in that epoch's permutation)."""
        epoch, s, k = self.locate(g)
        return epoch, s * self.per_shard + k * self.batch

    def rows(self, g: int) -> np.ndarray:
        """The sample indices of batch `g`."""
        epoch, start = self.place(g)
        return self.permutation(epoch)[start : start + self.batch]

    def shard_rows(self, epoch: int, shard: int) -> np.ndarray:
        """Every whole batch of one shard in one epoch, shape (batches_per_shard, batch): an async worker's epoch."""
        start = shard * self.per_shard
        return self.permutation(epoch)[start : start + self.batches_per_shard * self.batch].reshape(-1, self.batch)


@dataclass
class SyncDeal:
    """One sync phase's share of the deal: from global step `step0`, where `dealt0` batches were dealt,
    each step deals the next `workers` numbers, worker `index` the `index`-th; `end` is the deal's end
    (--epochs), past which a worker has no batch in the step (the last step of a run whose worker count
    does not divide what is left)."""

    deal: Deal
    step0: int
    dealt0: int
    workers: int
    index: int
    end: int | None

    def dealt_at(self, step: int) -> int:
        """Batches dealt by the updates up to global step `step` of this phase."""
        dealt = self.dealt0 + (step - self.step0) * self.workers
        return dealt if self.end is None else min(dealt, self.end)

    def number(self, step: int) -> int | None:
        """This worker's batch of update `step + 1`, None when the deal has none left for it."""
        g = self.dealt0 + (step - self.step0) * self.workers + self.index
        return None if self.end is not None and g >= self.end else g

    def last_step(self) -> int | None:
        """The global step at which the deal runs out (None: endless)."""
        if self.end is None:
            return None
        return self.step0 + max(0, -(-(self.end - self.dealt0) // self.workers))

    def weight(self, step: int) -> int:
        """The batches update `step + 1` holds, over all workers."""
        return min(self.workers, max(0, self.end - self.dealt_at(step))) if self.end is not None else self.workers


def epochs(deal: Deal, applied: list[tuple[int, int]], lost: set[int] = frozenset()) -> list[dict]:
    """The summary's account of every epoch begun. `applied`: for each async worker (its shard, the
    batches of it applied in the run: a count that runs across epochs), or one (-1, dealt) for a sync
    job's deal. A worker in `lost` stopped for good: what is left of its shard in every epoch begun is
    `missed`. `repeated` and `dropped` are what the run applied twice or gave up by design (none here:
    kept for the modes that have them)."""
    spe, B = deal.batches_per_shard, deal.batch
    # batches per epoch behind each count: a sync deal's every number below it, or one worker's shard
    size = [deal.per_epoch if shard < 0 else spe for shard, _ in applied]
    n = 1 + max((count // k for (_, count), k in zip(applied, size)), default=0)
    per_epoch, missed = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for (_, count), k in zip(applied, size):
        full, part = divmod(count, k)
        per_epoch[:full] += k
        per_epoch[full] += part
    begun = int(np.flatnonzero(per_epoch).max()) + 1 if per_epoch.any() else 0
    for shard, count in applied:
        if shard in lost:
            for e in range(begun):
                missed[e] += spe - min(spe, max(0, count - e * spe))
    return [{"epoch": e, "samples": int(per_epoch[e]) * B, "missed": int(missed[e]) * B, "repeated": 0,
             "dropped": 0, "left": deal.left} for e in range(begun)]
