"""The exact slots behind a sync step's values (modes/sync_step.SyncStep's buffer): [values..., loss, weight, stop
vote, room vote, save vote, step stamp], and the check that a sum of them is every worker's whole part of
one step (`torn`)."""

from __future__ import annotations

from mpitrain.core.codec import CODECS

LOSS, WEIGHT, VOTE, ROOM_VOTE, SAVE_VOTE, STAMP = range(6)
SYNC_SLOTS = STAMP + 1
STAMPS = 8  # the step stamp cycles through 1..STAMPS (fewer where the wire cannot sum W of them exactly)


def stamp_period(compress: str, workers: int) -> int:
    """How many stamps the step cycles through: `workers` of the largest must sum exactly on the wire
    (float32's 2**24 where the slots travel as they are: a codec of none, or a gathered part)."""
    exact = CODECS.get(compress, CODECS["none"]).exact
    return max(1, min(STAMPS, exact // max(workers, 1)))


def torn(workers: int, weight: float, votes: tuple[float, ...], stamped: float, stamp: int,
         weights: int | None = None) -> str | None:
    """Why a sum's exact slots say it is not every worker's whole part of this step (None: they agree).
    MPICH completed an Allreduce on a survivor with a part a dying worker had only half sent: applied,
    the parameters exploded and a regroup went on from them (tests/test_elastic.py, 1 in ~20 under
    load): hence the weight, each worker's 1. Then one completed with every weight and a stop vote
    that no worker had cast: the job stopped as if signalled (exit 143) one step after its regroup
    (CI, 2026-11-29; 5 in ~150 chaos trials under load, the coordinator killed): hence the stamp, and
    votes that must count workers. Such a sum is never applied: a worker died in it (await_verdict).
    `weights`: the batches in the step, where fewer than the workers (the deal's last step)."""
    weights = workers if weights is None else weights
    if weight != weights:
        return f"the sum holds a weight of {weight:g}, not {weights}: a worker died sending its part"
    if stamped != workers * stamp:
        return f"the sum's step stamp is {stamped:g}, not {workers * stamp}: a part is torn or of another step"
    for kind, vote in zip(("stop", "room", "save"), votes):
        if vote not in range(workers + 1):
            return f"the sum holds {vote:g} {kind} votes of {workers} workers: a part is torn"
    return None
