"""What a rank reports to rank 0 at the end of a run: typed here, JSON bytes on the wire.

A worker sends a WorkerReport, a parameter server other than rank 0 (--num-ps) a ShardReport,
point to point (trainer.send_report): never pickled; every rank runs the same mpitrain (agreed at
setup), so both ends know the fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class WorkerReport:
    rank: int
    pushed: int  # gradients computed and sent (sync: local steps taken)
    dropped: int  # gradients left out of every update (--quorum)
    diverged: dict | None  # the non-finite or exploding loss that stopped it, if any
    contributed: int | None  # sync: gradients that went into updates
    test_loss: float  # of this worker's own parameters
    test_accuracy: float
    digest: str  # hash of its final parameters (equal on every worker in sync mode)
    time_breakdown: dict  # fractions of wall time: compute, communication_and_wait, other
    step_time: dict  # observe.Activity.report(): median step time and its spread
    max_rss_mb: list[float] | None = None  # [start, end] of training (a local run's own report: None)
    timeline: list[dict] = field(default_factory=list)  # --timeline spans

    role = "worker"


@dataclass
class ShardReport:
    """A parameter server's account of its shard (the summary's ps_shards entries)."""

    rank: int
    host: str
    shard: int
    params: int
    busy_fraction: float
    global_step: int
    bytes_in: int
    bytes_out: int
    staleness: dict
    diverged: dict | None
    timeline: list[dict] = field(default_factory=list)

    role = "shard"

    def entry(self) -> dict:
        """The summary's ps_shards entry (the spans go to the trace)."""
        out = asdict(self)
        del out["timeline"]
        return out


KINDS = {kind.role: kind for kind in (WorkerReport, ShardReport)}


def to_bytes(report: WorkerReport | ShardReport) -> bytes:
    return json.dumps({"role": report.role, **asdict(report)}).encode()


def from_bytes(data: bytes) -> WorkerReport | ShardReport:
    fields = json.loads(data)
    return KINDS[fields.pop("role")](**fields)
