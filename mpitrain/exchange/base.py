"""The exchange's interfaces, which a mode's loop is written against: Reducer (sync), PushPull (an async
worker), ServerSide (an async server). MPI's are in mpi.py and serving.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mpitrain.duties.checkpoint import TrainState


class Reducer(Protocol):
    """How sync workers sum a buffer, in place, over all of them: SyncStep's [gradient..., loss,
    weight, stop vote, step stamp]. MPIReducer is the one mpitrain uses; another transport (NCCL between GPUs)
    is another class with this one method. `sum` returns whether it summed anything (False: this
    worker is alone, the buffer is already the sum). `alone` says so beforehand: SyncStep then keeps
    its loss and stop vote on the host (on a GPU, four scalar writes and a host read fewer a step).
    --outer-overlap takes the sum in three parts: `start` it (a handle; MPI reads `buf` from then on),
    `progress` it between inner steps (one look, no wait), `finish` it (the sum in that `buf`; the caller
    accounts the wait as ALLREDUCE, as `sum` does). `part`: which parameters buf's values are, where they
    are not all of them (--fragments; a compressed exchange keeps error feedback for each)."""

    alone: bool

    def sum(self, buf, part: slice | None = None) -> bool: ...

    def start(self, buf, part: slice | None = None): ...

    def progress(self, flight) -> None: ...

    def finish(self, flight) -> None: ...


class PushPull(Protocol):
    """An async worker's side: it computes into `gradient(slot)` on `params` (whose versions, one
    per server, are `versions`), `push`es the slot, and later `pull`s the answer, which becomes
    `params`. Two slots, so that with --overlap one push is in flight while the next gradient is
    computed."""

    params: object  # the parameters to compute on (the backend's array)
    versions: list[int]  # each server's global step of `params`
    diverged_at: int | None  # a server stopped the run at this step because a loss diverged
    in_flight: bool  # a push whose answer has not been pulled
    lent: tuple[int, int] | None  # the block of batch numbers rank 0's last answer lent (core/ledger.Leases)
    mark: tuple[int, int]  # what that answer (or the start) said of `params`' deal (core/ledger.mark)

    def gradient(self, slot: int): ...

    def push(self, slot: int, loss: float, versions: list[int], count: int, last: bool,
             lease: tuple[int, int] | None = None) -> None: ...  # `lease`: the block it was computed on

    def progress(self) -> None: ...  # one look at the push in flight, no wait (between --local-steps' inner steps)

    def pull(self, count: int) -> bool: ...  # True: a server stopped this worker (after `count` pushes)

    def leave(self, count: int) -> None: ...  # it stops with nothing pushed: tell every server

    def held(self) -> TrainState: ...  # what a take-over starts from, should rank 0 be lost (failover.py)

    def close(self) -> None: ...


class ServerSide(Protocol):
    """A server's side of async's push/pull (WorkerLinks is MPI's, exchange/serving.py), the seam the server loops
    (modes/async_.py, modes/shm_remote.py) are written against: `next` arrivals (their pushes in `inbox[i]`, as
    `pushes` reads them), the buffer of i's answer (`reply_to`, written as `replies` writes), `send` it, `drop` a
    lost worker, `drain` the last replies, `close`. A new transport is a class with these, named in
    serving.SERVER_SIDES under the --ps-transport value that picks it (tests/test_structure.py holds the loops
    to this list)."""

    inbox: list  # worker i's last push (a protocol.Message)
    outbox: list  # worker i's reply buffers (shm's remote workers reply straight from them)
    pushes: object  # core.compress.Pushes: what a push carries, read into a gradient
    replies: object  # core.compress.Replies: what an answer carries, written from the parameters

    def awaits(self, i: int) -> bool: ...

    def next(self, extra: list | None = None, wait: bool = True): ...  # transport.Completed

    def over_mpi(self, i: int, reply: bool = False) -> int: ...

    def reply_to(self, i: int): ...

    def send(self, i: int, more: bool) -> None: ...

    def drop(self, i: int) -> None: ...

    def drain(self, poller=None) -> None: ...

    def close(self) -> None: ...
