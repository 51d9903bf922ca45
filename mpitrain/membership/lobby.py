"""Rank 0's side of a job that can grow while it trains (join.py has the protocol): the Lobby
connects to a joiner's request, lets it in or refuses it, and requests the stop that makes room;
at the phase's end, why_not_there asks the joiner it let in whether it is still there."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

from mpi4py import MPI

from mpitrain.core.config_io import disagreement
from mpitrain.core.console import say
from mpitrain.core.layout import PS_RANK
from mpitrain.exchange.protocol import FLAG_PEER_LOST
from mpitrain.launch import faults
from mpitrain.launch.faults import Kill
from mpitrain.membership import respawn
from mpitrain.membership.join import (ANSWER_S, CONNECT_TIMEOUT_S, FRESH_S, REQUESTS, SCAN_EVERY_S, Carry, Joiner,
                                      dead_here, gave_up, job_folder, last_line, recv_json, remove, send_json,
                                      tell_to_leave)
from mpitrain.membership.stuck import WATCHDOG


class Lobby:
    """Rank 0's side while a job that can grow trains: looked at in every wait of the phase
    (trainer: watch.during). It connects to a fresh request, lets the joiner in or refuses it,
    and on the first it lets in requests the stop that makes room (`joiner`)."""

    def __init__(self, ctx, carry: Carry, heartbeat=None):
        self.carry = carry  # the job's token, flags as given and step budget; what --respawn may still do
        self.heartbeat = heartbeat  # liveness.Heartbeat: beats out the stop that makes room at once
        self.watch = ctx.watch  # its lost workers: --respawn replaces them
        self.stop = ctx.stop  # the job's stop request: never let a worker in while one is due
        self.lost_seen = 0
        self.spawn = False  # --respawn: start a worker where this phase ends (grow), or let in the one started
        self.launch_at: float | None = None  # --respawn, rank 0 spawning alone: when to start the worker
        self.starting: respawn.Starting | None = None  # ... started, training on
        self.started: Joiner | None = None  # ... that said hello: the phase's end lets it in (why_not_there first)
        self.dir = job_folder(ctx.cfg) / REQUESTS
        self.joiner: Joiner | None = None
        self.spare = None  # spares.Spare: the joiner let in is a spare of the job's (--spares)
        self.connect_s = connect_timeout_s(ctx.cfg.worker_timeout)
        self._next = 0.0
        if carry.spares is not None:
            carry.spares.budget = carry.budget  # the beats carry it: a spare let in trains to it

    def check(self) -> None:
        if self.carry.spares is not None:
            self.carry.spares.tend()
        if self.launch_at is not None:
            if time.monotonic() >= self.launch_at:
                self._launch()
            return
        if self.starting is not None and self.started is None:
            self._look_at_start()
            return
        if self.joiner is not None or self.spawn or self.stop.due:  # one at a time; never into a stop
            return
        # A loss is looked for at every look (a list's length), the folder only every SCAN_EVERY_S: the
        # replacement's start waited up to that long after the loss was declared (0.25 s a respawn, median).
        if self._spare_due():
            return
        if self._respawn_due():
            more = f"--respawn: {self.carry.respawns_left} more after this one"
            # Where rank 0 spawns alone (MPICH) the job trains on while the worker starts, sync included: sync
            # spawning at the phase's end stalled every worker through the spawn and the start-up (0.81 s a
            # replacement, benchmarks/GOODPUT.md 2026-12-04). It was at the phase's end for sync since 239cb46,
            # whose chaos trials lost 3 of 8 replacements with the early start; the started worker has waited
            # for rank 0's GO since that same commit, and 32 of 32 respawn-sync trials now end as documented.
            if not respawn.spawns_alone():  # at the phase's end, every rank spawning together
                self.spawn = True
                say(f"mpitrain: starting a worker in place of the one lost at the next step boundary ({more})")
                self._make_room()
                return
            say(f"mpitrain: starting a worker in place of the one lost; training goes on until it is ready ({more})")
            self.launch_at = time.monotonic() + respawn.AFTER_LOSS_S
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + SCAN_EVERY_S
        for path in self._requests():
            self._consider(path)
            if self.joiner is not None:
                return

    def _requests(self) -> list[Path]:
        try:
            return sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []

    def _consider(self, path: Path) -> None:
        try:
            touched = time.time() - path.stat().st_mtime
            request = json.loads(path.read_text())
            port, host, pid = str(request["port"]), str(request["host"]), int(request["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # being written, or gone: the next scan sees it whole
        if touched > FRESH_S or dead_here(host, pid):  # its joiner died: never connect to a dead port
            remove(path)
            return
        info = MPI.Info.Create()
        info.Set("timeout", str(self.connect_s))
        try:
            with WATCHDOG.paused():  # bounded by its own timeout; the heartbeat thread may wait on it
                inter = MPI.COMM_SELF.Connect(port, info)
        except MPI.Exception as e:
            # A connect takes 3-25 ms here (measured); one past connect_s will not come. Rank 0's own
            # receive path may be what is blocked (docs/elastic.md: a joined worker SIGKILLed mid-message
            # can block MPICH's UCX receive queue for good), so the line says what to try.
            gave_up(path)
            say(f"mpitrain: could not connect to the worker waiting to join on {host} (pid {pid}) within "
                f"{self.connect_s} s: {last_line(e)}; the job goes on without it (start that worker again; "
                f"should joins keep failing, restart the job: it resumes from its newest checkpoint)")
            return
        finally:
            info.Free()
        remove(path)  # one connection per request: a refused joiner does not come back
        self._admit(inter, host, pid)

    def owe(self, losses: int) -> None:
        """--respawn: `losses` of an earlier phase not replaced yet count as lost workers of this one
        (join.Carry.owed), so the job starts a rank in place of each and grows back to the size it had:
        the workers lost with the one replaced as the last phase ended (a host's failure takes all of
        its workers at once), or the lost rank 0 after a take-over (failover.py)."""
        self.lost_seen -= losses

    def unreplaced(self, recorded=()) -> int:
        """At a phase's end that lets a worker in: the losses of this phase (and those it was owed)
        that no replacement was started for; the next phase owes them (`owe`)."""
        return max(0, len(self.lost(recorded)) - self.lost_seen)

    def lost(self, recorded=()) -> set[int]:
        """The ranks lost in this phase: the watch's, and `recorded`, the phase's lost workers as the
        summary will list them (a report's wait records a worker whose send failed without the watch
        declaring it)."""
        return set(self.watch.lost) | {w["rank"] for w in recorded}

    def _loss_unseen(self, recorded=()) -> bool:
        """--respawn or --spares: a worker was lost in this phase since the last look, and the job may
        still replace it."""
        return len(self.lost(recorded)) > self.lost_seen and (self.carry.respawns_left > 0 or bool(self.carry.spares))

    def _spare_due(self) -> bool:
        """--spares: a lost worker's place goes to a waiting spare (before --respawn starts a process):
        it is let in as a joiner that connected, at the next step boundary."""
        pool = self.carry.spares
        if not pool or not self._loss_unseen():
            return False
        spare = pool.take()
        if spare is None:  # the last one was gone
            return False
        faults.spare_taken(spare.pid)
        self.lost_seen += 1
        self.spare, self.joiner = spare, spare.joiner()
        say(f"mpitrain: spare rank {spare.world_rank} on {spare.host} takes the lost worker's place at the next "
            f"step boundary ({len(pool)} spare(s) left)")
        self._make_room()
        return True

    def _respawn_due(self) -> bool:
        """A replacement is to be started (each loss gets one try, whatever becomes of it; losses seen
        at one look, two workers of a host that failed, get one each, in turn)."""
        if not self._loss_unseen() or self.carry.respawns_left <= 0:
            return False
        self.lost_seen += 1
        self.carry.respawns_left -= 1
        return True

    def _admit(self, inter, host: str, pid: int) -> None:
        """A connection to a would-be joiner: its hello, then let it in or refuse it, both in one line."""
        hello = recv_json(inter, 0, ANSWER_S) or {}
        why = self._refusal(hello)
        try:
            send_json(inter, {"ok": why is None, "why": why or "", "budget": self.carry.budget}, 0)
        except MPI.Exception:
            why = why or "it died while joining"
        if why:
            say(f"mpitrain: refused a worker on {host} (pid {pid}): {why}")
            inter.Disconnect()
            return
        self.joiner = Joiner(inter, host, pid)
        say(f"mpitrain: a worker on {host} (pid {pid}) joins: making room at the next step boundary")
        self._make_room()  # trainer.run goes on with the joiner
        Kill(PS_RANK).let_in()

    def _launch(self) -> None:
        self.launch_at = None
        if self.heartbeat is not None:  # the spawn holds the heartbeat thread too: the peers are told first
            self.heartbeat.hold()
        try:
            self.starting, failure = respawn.launch(self.carry.spawn_argv())
        finally:
            if self.heartbeat is not None:
                self.heartbeat.release()
        if self.starting is None:
            respawn.not_started(failure)

    def _look_at_start(self) -> None:
        """The worker started in place of a lost one: once its hello is in, make room for it; if its
        set-up failed, or it stayed silent, the job trains on without it (respawn.Starting.settled)."""
        settled = self.starting.settled()
        if settled is None:
            return
        self.started, why = settled
        if self.started is not None:
            self.spawn = True
            self._make_room()
        else:
            respawn.not_started(why)
            self.starting = None

    def settle(self) -> None:
        """The phase over, the job not: wait for the hello of a worker still starting (what is left
        of its HELLO_WITHIN_S), so that a job whose every worker was lost goes on with it."""
        while self.launch_at is not None or (self.starting is not None and self.started is None):
            self.check()
            time.sleep(1e-3)

    def _make_room(self) -> None:
        """Every mode ends this step as for Ctrl-C, but the job goes on: the request spreads with every
        message, and the heartbeats go out now (a sync worker hears rank 0 in nothing else)."""
        self.stop.make_room()
        if self.heartbeat is not None:
            self.heartbeat.poke()

    def _refusal(self, hello: dict) -> str | None:
        if not secrets.compare_digest(str(hello.get("token", "")), self.carry.token):
            return "it did not show this job's token (another job's folder, or not mpitrain)"
        detail = disagreement(self.carry.identity, hello.get("identity") or {})
        return f"its flags differ from the job's ({detail}); join with the job's flags" if detail else None

    def pending(self, recorded=()) -> bool:
        """At the phase's end: a joiner let in, a replacement to start, or a worker lost since the
        last look that --respawn would have replaced (lost as training ended: in the reports' wait,
        where the loss is declared by the look that raises, so no later look saw it; measured once
        in 84 chaos trials, the job ending with no word of the replacement; and once in 12 more, a
        loss only the reports' wait had recorded: `recorded`, the phase's lost_workers)."""
        return (self.joiner is not None or self.spawn or self.starting is not None or self.launch_at is not None
                or self._loss_unseen(recorded))

    def release(self, why: str, recorded=()) -> None:
        """The job ends instead of growing: tell the joiner it let in, and let it go; say why no
        worker is started in place of a lost one."""
        if self.starting is not None:
            respawn.dismiss(self.starting)
            say(f"mpitrain: the worker started in place of the lost one did not join: {why}")
            self.starting = self.started = None
            self.spawn = False
        # the replacement about to start (its loss is counted as seen), and the losses none was started for yet
        about_to_start = int(self.spawn or self.launch_at is not None)
        unstarted = about_to_start + min(self.unreplaced(recorded), self.carry.respawns_left + len(self.carry.spares or ()))
        if unstarted:
            whom = "the lost one" if unstarted == 1 else f"any of the {unstarted} lost"
            say(f"mpitrain: no worker was started in place of {whom}: {why}")
            self.spawn, self.launch_at = False, None
        if self.joiner is None:
            return
        if self.spare is not None and dead_here(self.joiner.host, self.joiner.pid):
            self.carry.spares.lost_one = True  # it died as the job made room: in every COMM_WORLD (trainer._phase)
        tell_to_leave(self.joiner.inter, flags=FLAG_PEER_LOST if self.spare is not None else 0)  # a spare: after a loss
        say(f"mpitrain: the {'spare' if self.spare is not None else 'worker'} on {self.joiner.host} "
            f"(pid {self.joiner.pid}) did not join: {why}")
        self.joiner = self.spare = None


def connect_timeout_s(worker_timeout: float) -> int:
    """MPI_Comm_connect's bound for rank 0: while it waits, so does its heartbeat thread (MPICH's
    lock), so it stays at half the workers' --worker-timeout or less, or a slow connect makes
    them declare rank 0 lost (CI, 2026-11-27: a connect that timed out after 5 s under
    --worker-timeout 2 cost the job a worker, then the joiner). At least MPICH's 1 s grain."""
    return max(1, min(CONNECT_TIMEOUT_S, int(worker_timeout // 2)))
