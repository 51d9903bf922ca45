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

An async job (one that pushes and pulls through rank 0) takes the same numbers as leases (Leases):
rank 0 hands a worker a block of numbers with each reply (one; --local-steps H: up to H), the worker
computes on it, and its push names the block back, which rank 0 marks applied. A worker holds at most
two blocks (the one it computes on, and with --overlap the next), so rank 0 knows at every moment
which numbers are out and where: a worker lost, a phase ended by a join or a stop, or a checkpoint
turns what is out into blocks to deal again (`redeal`), first in line, so the epoch they belong to
is finished by whoever is left. Why leases rather than each worker reading its own shard: a shard
follows its worker, and a worker's loss took the shard's rest with it; a lease is one rank's
decision, with the reply that is sent anyway (two header slots), and costs nothing measurable.

What is not exact, named: with --num-ps K a worker that dies half-way through a push may have reached
another server but not rank 0, which deals the block again (that slice applies it twice, uncounted); a
take-over of rank 0 puts the ledger together from what the survivors were lent and told (failover.lent_ledger):
each reply says below which number every batch is applied, and how many are (Leases.mark), so every number
above the freshest copy's mark that no survivor had answered is dealt again (none is missed: rank 0's own
blocks to deal again, those of workers lost with it), and those the copy had applied are counted `repeated`
(a block pushed and not answered, or answered to a worker lost with rank 0).
The few samples past the last whole batch of each shard wait for a later epoch's reshuffle (`left`).
Over the shm store the same Leases live in the store's arrays (PairQueue): a worker grants itself its next
block in the hold of the lock it applies under, and rank 0 puts a lost worker's back.

--quorum deals as sync (a worker computes on the newest parameters it has, with its batch of that step)
and each update takes Q of the step's batches: the others are `left_out`, counted by epoch on every
worker from the update's weights (SyncStep.leave_out), carried with `dealt` (regroups, checkpoints) and
sent to rank 0 with each state it saves; the summary's `dropped`. Its last step deals every worker a
batch: the few batches left below the worker count are not dealt.

`epochs` writes the summary's account of every epoch begun. Nothing here is per sample: a deal is
four integers, the leases a few blocks per worker.
"""

from __future__ import annotations

from collections import deque
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
        """Every whole batch of one shard in one epoch, shape (batches_per_shard, batch) (data.epoch_batches)."""
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

    def left_out(self, step: int, span: int, chosen) -> dict[int, int]:
        """--quorum: the batches of updates `step + 1` to `step + span` that were dealt to a worker not
        in `chosen` (worker indices) and so never applied, by epoch. Worker w's batches in those updates
        are w-th of each update's numbers: every `workers`-th number, spread over at most a few epochs."""
        P, W, out = self.deal.per_epoch, self.workers, {}
        for w in range(W):
            if w in chosen:
                continue
            g, n = self.dealt0 + (step - self.step0) * W + w, span  # its first number, and how many
            while n > 0:
                epoch = g // P
                k = min(n, -(-((epoch + 1) * P - g) // W))  # those of its numbers still in `epoch`
                out[epoch] = out.get(epoch, 0) + k
                g, n = g + k * W, n - k
        return out

    def last_step(self, whole: bool = False) -> int | None:
        """The global step at which the deal runs out (None: endless); `whole`: the last step that deals
        every worker a batch (no short last step)."""
        if self.end is None:
            return None
        left = max(0, self.end - self.dealt0)
        return self.step0 + (left // self.workers if whole else -(-left // self.workers))

    def weight(self, step: int) -> int:
        """The batches update `step + 1` holds, over all workers."""
        return min(self.workers, max(0, self.end - self.dealt_at(step))) if self.end is not None else self.workers


Block = tuple[int, int]  # (first batch number, how many): one lease


class PairQueue:
    """The deque of blocks Leases uses, over int64 memory another process can map (the shm store's): `pairs`,
    a flat ring of (first, count) pairs, and `counts` = [head, length], each a sequence of ints (a memoryview
    of the store: its items are Python ints, ~7x cheaper than NumPy's scalars, and this runs under the lock
    every push waits on). Only the methods Leases calls. Whoever changes it holds the store's lock."""

    __slots__ = ("pairs", "counts", "cap")

    def __init__(self, pairs, counts):
        self.pairs, self.counts, self.cap = pairs, counts, len(pairs) // 2

    def __len__(self) -> int:
        return self.counts[1]

    def __iter__(self):
        return iter([self[i] for i in range(len(self))])

    def __getitem__(self, i: int) -> Block:
        k = 2 * ((self.counts[0] + i) % self.cap)
        return self.pairs[k], self.pairs[k + 1]

    def _put(self, slot: int, block: Block) -> None:
        self.pairs[2 * slot], self.pairs[2 * slot + 1] = block

    def append(self, block: Block) -> None:
        head, n = self._room()
        self._put((head + n) % self.cap, block)
        self.counts[1] = n + 1

    def appendleft(self, block: Block) -> None:
        head, n = self._room()
        head = (head - 1) % self.cap
        self._put(head, block)
        self.counts[0], self.counts[1] = head, n + 1

    def _room(self) -> tuple[int, int]:
        """[head, length], once there is room for one more block."""
        head, n = self.counts[0], self.counts[1]
        if n == self.cap:
            raise RuntimeError(f"the shared ledger's queue of {self.cap} blocks is full")
        return head, n

    def extendleft(self, blocks) -> None:
        for block in blocks:
            self.appendleft(block)

    def popleft(self) -> Block:
        block = self[0]
        self.counts[0], self.counts[1] = (self.counts[0] + 1) % self.cap, self.counts[1] - 1
        return block

    def clear(self) -> None:
        self.counts[1] = 0


class Leases:
    """An async job's deal, on rank 0 (and, to agree on the first blocks, on every worker): `fresh` is
    the next number never dealt, `redeal` the blocks to deal again before it, `out[w]` worker w's blocks,
    oldest first. `span` numbers per block (--local-steps), `end` where --epochs run out (None: endless).
    The first `depth` blocks of each worker are dealt here, the same on every rank, so the start needs
    no message: worker w takes the w-th block of each round."""

    def __init__(self, fresh: int, redeal: list[Block], workers: int, depth: int, span: int, end: int | None):
        self._fresh = [fresh]  # a list, as the store's memoryview (Leases.over): no NumPy scalar per grant
        self.span, self.end = span, end
        self.redeal = deque(redeal)
        self.out: list[deque] = [deque() for _ in range(workers)]
        self._unapplied, self._low = sum(n for _, n in redeal), None  # mark's, kept as it goes: it runs per reply
        for _ in range(depth):
            for w in range(workers):
                self.grant(w)

    @classmethod
    def over(cls, fresh, redeal: PairQueue, out: list[PairQueue], span: int, end: int | None) -> Leases:
        """The same ledger kept in shared memory (the shm store's: every worker grants itself its next block,
        rank 0 takes a lost one's back, each under the store's lock): `fresh` a one-int sequence (memoryview)."""
        leases = cls.__new__(cls)
        leases._fresh, leases.redeal, leases.out, leases.span, leases.end = fresh, redeal, out, span, end
        leases._unapplied, leases._low = 0, None  # (no mark: the store's ledger outlives rank 0 itself)
        return leases

    @property
    def fresh(self) -> int:
        return self._fresh[0]

    @fresh.setter
    def fresh(self, value: int) -> None:
        self._fresh[0] = value

    def grant(self, w: int) -> Block | None:
        """The next block to worker w (None: the deal has nothing left to hand out now)."""
        if self.redeal:
            first, n = self.redeal.popleft()
            if n > self.span:  # dealt by a run with a longer --local-steps
                self.redeal.appendleft((first + self.span, n - self.span))
                n = self.span
        else:
            n = self.span if self.end is None else min(self.span, self.end - self.fresh)
            if n <= 0:
                return None
            first = self.fresh
            self.fresh += n
            self._unapplied += n
        self.out[w].append((first, n))
        return first, n

    def applied(self, w: int, block: Block) -> bool:
        """Worker w's push of `block` is applied: False when w holds no such block first in line (a bug or
        a message from another run: the caller raises)."""
        if not self.out[w] or self.out[w][0] != block:
            return False
        self.out[w].popleft()
        self._unapplied -= block[1]
        if block[0] == self._low:
            self._low = None
        return True

    def lose(self, w: int) -> None:
        """Worker w is gone (lost, or its phase ended): its blocks are dealt again, before any other."""
        self.redeal.extendleft(reversed(self.out[w]))
        self.out[w].clear()

    def holds(self, w: int) -> bool:
        return bool(self.out[w])

    def anyone_holds(self) -> bool:
        return any(self.out)

    def unapplied(self) -> list[Block]:
        """Every block dealt and not applied: what a checkpoint keeps to deal again."""
        return list(self.redeal) + [b for q in self.out for b in q]

    def mark(self) -> tuple[int, int]:
        """What every reply tells its worker of the parameters it carries (mark). The lowest number out is looked
        for again only once the block that held it is applied (0.7 us with 2 workers, 2 us with 16)."""
        if self._low is None:
            low = self.fresh
            for q in (self.redeal, *self.out):
                for first, _ in q:
                    if first < low:
                        low = first
            self._low = low
        return self._low, self.fresh - self._unapplied


def mark(fresh: int, unapplied: list[Block]) -> tuple[int, int]:
    """(low, applied) of parameters whose deal is at `fresh` with these blocks not applied: every number below
    `low` is applied in them, and `applied` numbers in all. A take-over (failover.lent_ledger) deals again
    every number from the freshest copy's `low` that no survivor had answered, so none is missed, and counts
    as repeated those of them the copy holds: `applied` less `low`, less those answered."""
    return min((first for first, _ in unapplied), default=fresh), fresh - sum(n for _, n in unapplied)


def put_together(dealt: int, low: int, applied: int, answered: list[Block], held: list[Block], in_flight: list[Block],
                 per_epoch: int) -> tuple[list[Block], int | None, dict[int, int]]:
    """A take-over's deal when rank 0, which kept the Leases, is lost (failover.lent_ledger): from the freshest
    copy's mark (`low`, `applied`), the furthest number lent to a survivor or `low` (`dealt`), the blocks they were
    `answered` (applied), `held` (lent, begun or pushed) and pushed with no answer (`in_flight`, of `held`).

    Returns the blocks to deal again first: every number from `low` up to `dealt` that no survivor had answered
    (none is missed: rank 0's own blocks to deal again and those of workers lost with it are among them; the
    numbers from `dealt` on are dealt afresh). The copy holds `applied` - `low` numbers from `low` on, and those
    that no survivor had answered are dealt twice: their count (None: the mark and the answers disagree), and
    by epoch, counted in the first numbers dealt again that no survivor held unpushed (which are not known)."""
    answered = _union(b for b in answered if b[0] + b[1] > low)
    redeal = _less(dealt, low, answered)
    twice = left = applied - low - sum(first + n - max(first, low) for first, n in answered)
    if twice < 0:
        return redeal, None, {}
    by_epoch: dict[int, int] = {}
    unpushed = _union(b for b in held if b not in in_flight)
    for first, n in [*_less(dealt, low, _union(answered + unpushed)), (dealt, twice)]:
        count_by_epoch(by_epoch, (first, min(n, left)), per_epoch)
        left -= min(n, left)
    return redeal, twice, by_epoch


def count_by_epoch(counts: dict[int, int], block: Block, per_epoch: int, times: int = 1) -> None:
    """A block's numbers into `counts`, by epoch (the summary's `repeated`: a block dealt again though (part of)
    its gradient is in the parameters; `partial`); `times` -1 takes them out again."""
    for g in range(block[0], block[0] + block[1]):
        counts[g // per_epoch] = counts.get(g // per_epoch, 0) + times


def count_partial(partial: dict[int, int], mine: np.ndarray, others: list[np.ndarray], per_epoch: int) -> None:
    """--num-ps: each server's tally, a row per worker (worker, batches applied from it, first number of its last
    block), rank 0's `mine` against the `others`. A worker whose count differs between servers had that many
    batches applied on some slices only: into `partial`, in the epoch of the last block the server ahead applied."""
    for w in range(len(mine)):
        ahead, block = 0, -1
        for rows in others:
            d = int(rows[w, 1] - mine[w, 1])
            if abs(d) > abs(ahead):
                ahead, block = d, int(rows[w, 2] if d > 0 else mine[w, 2])
        if ahead and block >= 0:
            partial[block // per_epoch] = partial.get(block // per_epoch, 0) + abs(ahead)


def within(block: Block, blocks: list[Block]) -> list[Block]:
    """The parts of `block` that `blocks` hold."""
    a, end = block[0], block[0] + block[1]
    parts = [(max(a, f), min(end, f + n) - max(a, f)) for f, n in blocks]
    return [p for p in parts if p[1] > 0]


def _union(blocks) -> list[Block]:
    """Blocks as the fewest that cover the same numbers, in order."""
    out: list[list[int]] = []
    for first, n in sorted(blocks):
        if out and first <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], first + n - out[-1][0])
        else:
            out.append([first, n])
    return [(a, n) for a, n in out]


def _less(end: int, low: int, covered: list[Block]) -> list[Block]:
    """The numbers from `low` up to `end` that `covered` (_union's) does not hold, as blocks."""
    gaps, at = [], low
    for first, n in covered + [(end, 0)]:
        if first > at:
            gaps.append((at, min(first, end) - at))
        at = max(at, first + n)
        if at >= end:
            break
    return [g for g in gaps if g[1] > 0]


def epochs(deal: Deal, dealt: int, unapplied: list[Block] = (), left_out: dict[int, int] | None = None,
           repeated: dict[int, int] | None = None, partial: dict[int, int] | None = None) -> list[dict]:
    """The summary's account of every epoch begun: the numbers below `dealt` were dealt, each applied once
    but those in `unapplied` (async: a block out, or to deal again, when the run ended; a resume deals it
    again: `missed` until then) and those `left_out` of the updates by --quorum (`dropped`, by epoch).
    A sync step's numbers are the step's, and rank 0 marks an async block applied once, with the push that
    names it: only a take-over of rank 0 deals again numbers its copy had applied, and the shm store a block
    whose worker died inside its apply (`repeated`, by epoch). With --num-ps a push can reach some servers and
    not others (`partial`, by epoch: counted where rank 0 says, `samples` or `missed`, and here too)."""
    left_out, repeated, partial = left_out or {}, repeated or {}, partial or {}
    P = deal.per_epoch
    begun = -(-dealt // P)
    missed = np.zeros(begun, np.int64)
    for first, n in unapplied:
        for g in range(first, first + n):
            missed[g // P] += 1
    out = []
    for e in range(begun):
        took = min(dealt, (e + 1) * P) - e * P
        dropped = left_out.get(e, 0)
        out.append({"epoch": e, "complete": took == P, "samples": int(took - missed[e] - dropped) * deal.batch,
                    "missed": int(missed[e]) * deal.batch, "repeated": repeated.get(e, 0) * deal.batch,
                    "dropped": dropped * deal.batch, "partial": partial.get(e, 0) * deal.batch, "left": deal.left})
    return out
