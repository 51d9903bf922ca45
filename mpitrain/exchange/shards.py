"""--num-ps K: how the servers' slices of one training state come together on rank 0.

Server k owns slice k of every flat array of the training state (checkpoint.state_arrays: the
parameters, the optimizer's state, the moving average). A shard's state travels as one Message
whose payload is its slices of those arrays one after the other (`checkpoint.to_flat` of the
shard's own TrainState). Rank 0 puts the K pieces together into the TrainState one server would
hold, so evaluation, logs and checkpoints never see shards, and a checkpoint resumes with any K.

Async: rank 0 asks (a header-only TAG_SHARD with FLAG_EVAL / FLAG_CKPT / FLAG_FINAL) only when it
evaluates or saves, and each server answers from its serve loop (ShardService). Sync: each server
receives its slices from the coordinator (worker 0) and forwards them (sync.keep_shard); rank 0
takes them in the order they come.
"""

from __future__ import annotations

import numpy as np

from mpitrain.core.layout import PS_RANK
from mpitrain.duties.checkpoint import TrainState, from_flat, state_arrays, to_flat
from mpitrain.exchange.protocol import FLAG_FINAL, TAG_SHARD, Message
from mpitrain.exchange.transport import receive_table, send_table


def assemble(pieces: list[tuple[slice, np.ndarray]], names: list[str], n: int, step: int, opt_t: int,
             positions: list[int]) -> TrainState:
    """The whole state from each shard's (slice, flat payload); with one shard, its payload."""
    if len(pieces) == 1:
        whole = pieces[0][1]
    else:
        table = np.empty((len(names), n), np.float32)
        for s, flat in pieces:
            table[:, s] = flat.reshape(len(names), s.stop - s.start)
        whole = table.ravel()
    state = from_flat(whole, names, n, step, positions)
    state.opt_t = opt_t
    return state


def cut(flat_whole: np.ndarray, names: list[str], n: int, s: slice, out: np.ndarray) -> None:
    """out <- slice s of each of the arrays laid out one after the other in flat_whole."""
    out.reshape(len(names), s.stop - s.start)[:] = flat_whole.reshape(len(names), n)[:, s]


class Gather:
    """Rank 0: the other servers' pieces of the state (nothing to do with one server)."""

    def __init__(self, ctx, poller):
        lay, n = ctx.layout, ctx.model.n_params
        self.ctx, self.poller = ctx, poller
        self.names = state_arrays(ctx.cfg)
        self.others = [(r, s) for r, s in zip(lay.server_ranks, lay.shard_slices(n)) if r != PS_RANK]
        self.ranks = [r for r, _ in self.others]
        self.boxes = [Message(len(self.names) * (s.stop - s.start)) for _, s in self.others]
        self.ask = Message(0)

    def __bool__(self) -> bool:
        return bool(self.others)

    def post(self) -> list:
        return [self.ctx.comm.Irecv(box.spec(), source=r, tag=TAG_SHARD) for r, box in zip(self.ranks, self.boxes)]

    def wait(self, reqs: list, peers: list[int]) -> list[tuple[slice, np.ndarray]]:
        """Each other server's (slice, piece), once `reqs` (with `peers[i]` request i's server)
        have all completed (PeerLost if one is lost)."""
        self.poller.all(reqs, peers)
        for r, box in zip(self.ranks, self.boxes):
            box.check(TAG_SHARD, r)
        return [(s, box.payload) for (_, s), box in zip(self.others, self.boxes)]

    def ask_all(self, step: int, flags: int) -> list[tuple[slice, np.ndarray]]:
        """Async: ask every other server for its piece now (flags say why; FLAG_FINAL: the last)."""
        recvs = self.post()
        self.ask.stamp(TAG_SHARD, step, flags=flags)
        sends = [self.ctx.comm.Isend(self.ask.spec(), dest=r, tag=TAG_SHARD) for r in self.ranks]
        return self.wait(recvs + sends, self.ranks + self.ranks)

    def tallies(self) -> list[np.ndarray]:
        """After the final pieces: each other server's counts of what it applied from each worker, a row
        per worker (AsyncServer._tally)."""
        return [receive_table(self.ctx.comm, r, TAG_SHARD, np.int64, 3, self.ctx.watch) for r in self.ranks]

    def steps(self) -> list[int]:
        """The global step each other server had reached in its last piece."""
        return [box.step for box in self.boxes]


class ShardService:
    """A server k > 0 in async mode: answers rank 0's requests for its shard's state, from its
    serve loop (one request posted among the gradients it waits for). The last request
    (FLAG_FINAL) is answered only once this server's own loop is over, so the final state holds
    every gradient this server applied."""

    def __init__(self, ctx, n_shard: int):
        self.ctx = ctx
        self.names = state_arrays(ctx.cfg)
        self.ask = Message(0)
        self.out = Message(len(self.names) * n_shard)
        self.req = ctx.comm.Irecv(self.ask.spec(), source=PS_RANK, tag=TAG_SHARD)
        self.last_asked = False

    def handle(self, state: TrainState, poller) -> None:
        """The request arrived: answer it (the last one waits for `finish`)."""
        self.ask.check(TAG_SHARD, PS_RANK)
        if self.ask.flags & FLAG_FINAL:
            self.last_asked = True
            return
        self._send(state, poller)
        self.req = self.ctx.comm.Irecv(self.ask.spec(), source=PS_RANK, tag=TAG_SHARD)

    def finish(self, state: TrainState, poller, tally: np.ndarray) -> None:
        """After the serve loop: answer requests until the last one, then send the final state and `tally`
        (Gather.tallies)."""
        while not self.last_asked:
            poller.all([self.req], [PS_RANK])
            self.handle(state, poller)
        self._send(state, poller)
        poller.all([send_table(self.ctx.comm, tally, PS_RANK, TAG_SHARD)], [PS_RANK])

    def _send(self, state: TrainState, poller) -> None:
        self.out.payload[:] = to_flat(state, self.names)
        self.out.stamp(TAG_SHARD, state.global_step, flags=self.ask.flags)
        poller.all([self.ctx.comm.Isend(self.out.spec(), dest=PS_RANK, tag=TAG_SHARD)], [PS_RANK])
