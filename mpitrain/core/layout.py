"""Which rank does what: the one place that knows the parameter servers are ranks 0..K-1
(--num-ps K, default 1) and the workers are the ranks after them, and how the flat parameter
vector is cut into the servers' shards. Everything else asks the layout (`worker_rank(w)`,
`worker_index(rank)`, `shard_slice(k)`, `peers(rank)`, ...) instead of doing `w + 1` arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

PS_RANK = 0  # the chief parameter server (shard 0): evaluation, logs, checkpoints

# Who a rank is, in every mode and in every module (Layout.role; the modes' loops are named after them).
CHIEF = "chief"  # rank 0: the global model, the progress bar, checkpoints, the summary
SERVER = "server"  # another parameter server of --num-ps K: one shard of the parameters
WORKER = "worker"  # computes gradients on its shard of the data


def shard_bounds(n: int, shards: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of each of `shards` contiguous slices of n elements, balanced by elements (not by
    layer: an MLP's first layer holds most of its parameters): sizes differ by at most one."""
    base, extra = divmod(n, shards)
    bounds, lo = [], 0
    for k in range(shards):
        hi = lo + base + (1 if k < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return tuple(bounds)


@dataclass(frozen=True)
class Layout:
    """The roles in a world of `size` ranks with `num_ps` parameter servers. A world of one is a
    single-process run: one process that is its own server and worker 0. The rank lists are worked out
    once (Context.workers is read on every step)."""

    size: int
    num_ps: int = 1
    lost: frozenset[int] = frozenset()  # workers lost and regrouped without (sync, elastic.py)

    @property
    def single(self) -> bool:
        return self.size == 1

    @cached_property
    def server_ranks(self) -> tuple[int, ...]:
        """Shard k is served by server_ranks[k]; the first is PS_RANK, the chief."""
        return () if self.single else tuple(range(PS_RANK, PS_RANK + self.num_ps))

    @cached_property
    def worker_ranks(self) -> tuple[int, ...]:
        """The workers training now: those the job started with, less the lost."""
        return tuple(r for r in self.started_ranks if r not in self.lost)

    @cached_property
    def started_ranks(self) -> tuple[int, ...]:
        servers = self.server_ranks
        return (PS_RANK,) if self.single else tuple(r for r in range(self.size) if r not in servers)

    @property
    def started_workers(self) -> int:
        """The workers the job started with: its step budget is counted in their epochs."""
        return len(self.started_ranks)

    def without(self, ranks) -> Layout:
        """This layout after losing the workers `ranks` (sync regroups, elastic.py)."""
        return Layout(self.size, self.num_ps, self.lost | frozenset(ranks))

    @cached_property
    def workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def shards(self) -> int:
        return max(1, len(self.server_ranks))

    def worker_rank(self, w: int) -> int:
        """The MPI rank of worker `w` (0-based)."""
        return self.worker_ranks[w]

    def worker_index(self, rank: int) -> int:
        """0-based index among the workers of MPI rank `rank` (a worker's)."""
        return self.worker_ranks.index(rank)

    def is_server(self, rank: int) -> bool:
        return rank in self.server_ranks

    def shard_index(self, rank: int) -> int:
        """The shard a server rank serves (the single-process run holds the one shard)."""
        return 0 if self.single else self.server_ranks.index(rank)

    def shard_slices(self, n: int) -> list[slice]:
        """Each shard's part of a flat vector of n parameters, in shard (server rank) order."""
        return [slice(lo, hi) for lo, hi in shard_bounds(n, self.shards)]

    def shard_slice(self, k: int, n: int) -> slice:
        """Shard k's part of a flat vector of n parameters."""
        return self.shard_slices(n)[k]

    def role(self, rank: int) -> str:
        """CHIEF, SERVER or WORKER: rank 0 is the chief in every mode, a single process included."""
        if rank == PS_RANK:
            return CHIEF
        return SERVER if self.is_server(rank) else WORKER

    def peers(self, rank: int) -> list[int]:
        """The ranks `rank` exchanges heartbeats with: a worker with every server; a server with
        every worker and every other server (rank 0 gathers their shards, and with --on-lost-server
        continue every server takes part in a lost shard's take-over, so each must hear of it);
        nobody in a single-process run."""
        if self.single:
            return []
        if not self.is_server(rank):
            return list(self.server_ranks)
        return sorted([r for r in self.server_ranks if r != rank] + list(self.started_ranks))
