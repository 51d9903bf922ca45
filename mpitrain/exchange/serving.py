"""A server's side of async's push/pull, the seam its loop is written against (as PushPull is a
worker's): the next arrivals, the pushed message, the reply, a lost worker dropped, the last replies
drained. The loops that use it -- the async server (modes/async_.py) and rank 0's remote workers under
--ps-transport shm (modes/shm_remote.py) -- hold, apply and decide; only this module posts their
messages.

WorkerLinks is MPI's message path (one Irecv posted per worker, an Isend per reply), with async's
mailboxes for a worker of another launch on rank 0's host (exchange/mailbox.py) behind the same
methods. Another transport (NCCL, MPI one-sided) is another class with these methods, named in
SERVER_SIDES (docs/architecture.md, "Adding a transport").

What was measured on the way (benchmarks/SERVER.md): per gradient the server's own work is a receive
copy, an apply and a reply copy; the rest is per-message Python and MPI calls of ~1 us each (a
request made, a Testsome, a header stamped: measured one by one), so persistent requests
(Send_init/Recv_init) would save ~2 us of ~200 and break the error path's "a completed request goes
null" (transport.Poller._sort_out): not used.
"""

from __future__ import annotations

from mpi4py import MPI

from mpitrain.core.compress import Pushes, Replies
from mpitrain.exchange.mailbox import ServerMail
from mpitrain.exchange.protocol import TAG_GRAD, TAG_PARAMS, Message
from mpitrain.exchange.transport import END_POLL_S, Completed, Poller, tested


class WorkerLinks:
    """One server's links to the workers `ranks` (index i is the worker at ranks[i]): their pushes in
    `inbox[i]`, the replies from `outbox[i]` (or a mailbox's slots). `poller` is the server's (its
    wait, its watch, its stuck-MPI hook)."""

    def __init__(self, ctx, n: int, ranks: list[int], poller: Poller):
        be = ctx.backend
        self.ctx, self.comm, self.ranks, self.poller = ctx, ctx.comm, list(ranks), poller
        W = len(ranks)
        self.pushes = Pushes(ctx.cfg, n, be)  # a scheme's part with --compress int8|int4 / --sparsify: read()
        self.inbox = [Message(self.pushes.count, be.host_alloc, self.pushes.dtype) for _ in range(W)]
        self.replies = Replies(ctx.cfg, n, be)  # the parameters, or with --compress-replies their change: write()
        self.outbox = [Message(self.replies.count, be.host_alloc, self.replies.dtype) for _ in range(W)]
        self.message_bytes = (self.inbox[0].buf.nbytes, self.outbox[0].buf.nbytes) if W else (0, 0)
        self.sends = [MPI.REQUEST_NULL] * W
        # A worker of another launch on this host is offered a mailbox (exchange/mailbox.py): recv[i] awaits
        # its answer; once it has mapped the mailbox its pushes are looked for there, not in MPI.
        self.mail = ServerMail(ctx, n, self.ranks)
        self.recv = [self._listen(i) for i in range(W)]
        for i in self.mail.offered:
            self.sends[i], self.recv[i] = self.mail.offer(i, self.ranks[i])

    def awaits(self, i: int) -> bool:
        """Whether a push of worker i may come (a receive posted, or its mailbox answered)."""
        return bool(self.recv[i]) or self.mail.awaits(i)

    def next(self, extra: list | None = None, wait: bool = True) -> Completed:
        """The workers whose push (or goodbye) arrived, and those whose message failed in MPI (index ->
        why: the sender died mid-message; never read). `extra`: other requests to wait for beside them,
        numbered from len(ranks) on (another server's TAG_SHARD request). `wait=False`: one look."""
        reqs = self.recv + extra if extra else self.recv
        also = self.mail.arrived if self.mail.offered else None
        done = self.poller.some(reqs, also=also) if wait else (self.poller.test(reqs) or Completed())
        arrived = []
        for i in done.arrived:
            if i < len(self.ranks) and self.mail.answering(i):  # mapped: pushes come there; not: over MPI
                self.recv[i] = MPI.REQUEST_NULL if self.mail.answered(i) else self._listen(i)
                self.ctx.watch.heard(self.ranks[i])
                continue
            if i in self.mail.boxes:  # a push in its mailbox: read where it lies
                self.inbox[i] = self.mail.push(i)
            arrived.append(i)
        done.arrived = arrived
        return done

    def over_mpi(self, i: int, reply: bool = False) -> int:
        """The bytes one push (or `reply`) of worker i moves through MPI (0 through a mailbox): the summary's count."""
        return 0 if i in self.mail.boxes else self.message_bytes[reply]

    def reply_to(self, i: int) -> Message:
        """The buffer of the answer to i's push; its previous reply has left (it has, in all but name: the
        worker answered it with this push). Stamp it, then `send`."""
        if i in self.mail.boxes:
            return self.mail.reply(i)
        if not tested(self.sends[i], self.ranks[i], self.ctx.watch):
            self.poller.all([self.sends[i]], [self.ranks[i]])
        return self.outbox[i]

    def send(self, i: int, more: bool) -> None:
        """Send the reply `reply_to(i)` filled; with `more`, listen for i's next push."""
        if i in self.mail.boxes:
            self.mail.announce(i)
            return
        self.sends[i] = self.comm.Isend(self.outbox[i].spec(), dest=self.ranks[i], tag=TAG_PARAMS)
        if more:
            self.recv[i] = self._listen(i)

    def drop(self, i: int) -> None:
        """Worker i was lost: requests to or from a dead process never complete (dropped, never waited
        on; the job then ends without MPI_Finalize, which would wait for them: trainer.py)."""
        self.recv[i] = self.sends[i] = MPI.REQUEST_NULL
        self.mail.drop(i)

    def drain(self, poller: Poller | None = None) -> None:
        """Wait for the last replies (PeerLost names a worker lost meanwhile: drop it and drain again)."""
        (poller or Poller(END_POLL_S, self.ctx.watch)).all(self.sends, self.ranks)

    def close(self) -> None:
        self.mail.close()

    def _listen(self, i: int):
        """Post the receive of i's next push over MPI (none for a worker offered a mailbox it took or may take)."""
        if i in self.mail.offered and i not in self.mail.declined:
            return MPI.REQUEST_NULL
        return self.comm.Irecv(self.inbox[i].spec(), source=self.ranks[i], tag=TAG_GRAD)


# --ps-transport -> a server's links to its workers. shm has none: its workers apply in the store
# (exchange/shm.py), and rank 0's links to the workers on other hosts are MPI's.
SERVER_SIDES = {"mpi": WorkerLinks}
