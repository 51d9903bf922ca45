"""Which rank does what: the one place that knows the parameter server is rank 0 and the workers
are the ranks after it. Everything else asks the layout (`worker_rank(w)`, `worker_index(rank)`,
`peers(rank)`, ...) instead of doing `w + 1` arithmetic, so that another arrangement (several
servers, say) is a change of this file and of the code that serves, not of every loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

PS_RANK = 0  # the parameter server; also the chief of reporting (evaluation, logs, checkpoints)


@dataclass(frozen=True)
class Layout:
    """The roles in a world of `size` ranks. A world of one is a local run: one process that is
    its own server and worker 0. The rank lists are worked out once (Context.workers is read on
    every step)."""

    size: int

    @property
    def local(self) -> bool:
        return self.size == 1

    @cached_property
    def server_ranks(self) -> tuple[int, ...]:
        return () if self.local else (PS_RANK,)

    @cached_property
    def worker_ranks(self) -> tuple[int, ...]:
        servers = self.server_ranks
        return (PS_RANK,) if self.local else tuple(r for r in range(self.size) if r not in servers)

    @cached_property
    def workers(self) -> int:
        return len(self.worker_ranks)

    def worker_rank(self, w: int) -> int:
        """The MPI rank of worker `w` (0-based)."""
        return self.worker_ranks[w]

    def worker_index(self, rank: int) -> int:
        """0-based index among the workers of MPI rank `rank` (a worker's)."""
        return self.worker_ranks.index(rank)

    def is_server(self, rank: int) -> bool:
        return rank in self.server_ranks

    def role(self, rank: int) -> str:
        return "local" if self.local else ("parameter-server" if self.is_server(rank) else "worker")

    def peers(self, rank: int) -> list[int]:
        """The ranks `rank` exchanges heartbeats with: a server with every worker, a worker with
        the servers; nobody in a local run."""
        if self.local:
            return []
        return list(self.worker_ranks if self.is_server(rank) else self.server_ranks)
