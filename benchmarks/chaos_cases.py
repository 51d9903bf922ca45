"""The chaos suite's cases (benchmarks/chaos.py runs them, chaos_judge.py says what each must end with): whom a
case kills in which run, and the command that starts it."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

from support import IMPL, ExitCode, Layout, mpiimpl, mpirun

NP = 4
TIMEOUT_S = 3.0  # --worker-timeout
GRACE_S = 10.0  # the job must end within TIMEOUT_S + GRACE_S of the kill
START_WAIT_S = 60.0
JOIN_WINDOW_S = 3.0  # rank0-join: the kill comes this long after the joiner starts, at most (it joins in ~1.2 s)
SPARE_WINDOW_S = 0.8  # spare-joining: ... after the worker's kill (a spare takes its place 0.1-0.5 s after it)
EXIT_PEER_LOST = ExitCode.PEER_LOST
# Ranks ending with PEER_LOST beside a SIGKILLed rank of their own mpirun (a rank 0 whose MPI got stuck,
# stuck.py; a world forming for a join that lost rank 0): MPICH's mpirun ORs in rank 0's supervisor's 137 when
# rank 0 was the one killed (a killed worker's supervisor exits 0: supervise.killed_exit)
STUCK_EXITS = (EXIT_PEER_LOST, (128 + signal.SIGKILL) | EXIT_PEER_LOST)
# Hydra ORs in rank 0's supervisor's 128 + 9 when rank 0 itself was killed (supervise.killed_exit);
# a killed worker's supervisor exits 0, so the job's code is the survivors' verdict.
RANK0_KILLED = 128 + signal.SIGKILL if IMPL is mpiimpl.MPICH else 0


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    target: str  # "worker", "coordinator" (the first worker), "rank0", "shard" (rank 1 with --num-ps 2), "supervisor"
    #              "launcher" (mpirun itself), "disk" (the checkpoint folder fills up), "joiner" (a
    #              worker started with --join, killed once it has joined: MPICH) or "rank0-join" (rank 0,
    #              killed at a random moment of a worker's join: MPICH)
    steps: int  # --steps: a run of several seconds on 2 cores
    sig: int = signal.SIGKILL  # SIGTERM / SIGINT: a user's or the scheduler's stop, not a crash
    env: tuple[str, ...] = ()  # VAR=value for every rank (`env` in front of python)
    window_s: float = 0.0  # > 0: the kill comes within this long of rank 0's start lines, not over the whole run

    @property
    def mode(self) -> str:
        return "sync" if "sync" in self.args else "async"

    @property
    def spares(self) -> int:
        """--spares N: the job's world is NP ranks, mpirun starts N more (world ranks NP..NP+N-1)."""
        return int(self.args[self.args.index("--spares") + 1]) if "--spares" in self.args else 0

    @property
    def layout(self) -> Layout:
        k = int(self.args[self.args.index("--num-ps") + 1]) if "--num-ps" in self.args else 1
        return Layout(NP, k)


BASE = ("--dataset", "synthetic", "--model", "mlp", "--no-progress", "--worker-timeout", str(TIMEOUT_S),
        "--checkpoint-every-steps", "200")
FAILOVER = ("--on-lost-server", "continue")
CASES = [
    Case("async", ("--mode", "async"), "worker", 20000),
    Case("async-staleness", ("--mode", "async", "--max-staleness", "2"), "worker", 15000),
    Case("async-big", ("--mode", "async", "--hidden", "2000"), "worker", 1200),
    Case("sync", ("--mode", "sync"), "worker", 4000),
    Case("sync-quorum", ("--mode", "sync", "--quorum", "2"), "worker", 2500),
    Case("coordinator-quorum", ("--mode", "sync", "--quorum", "2"), "coordinator", 2500),  # it gathers every quorum step
    Case("quorum-big", ("--mode", "sync", "--quorum", "2", "--hidden", "2000"), "worker", 300),  # 6.4 MB messages
    Case("sync-big", ("--mode", "sync", "--hidden", "2000"), "worker", 300),
    Case("coordinator-sync", ("--mode", "sync"), "coordinator", 4000),  # the workers left regroup under a new coordinator
    Case("sync-stop", ("--mode", "sync", "--on-lost-worker", "stop"), "worker", 4000),  # the old behaviour
    Case("rank0-async", ("--mode", "async", "--hidden", "2000"), "rank0", 1200),
    Case("rank0-sync", ("--mode", "sync"), "rank0", 4000),
    Case("supervisor", ("--mode", "async"), "supervisor", 20000),
    # --ps-transport shm: a worker killed at any moment, very often holding the store's lock or
    # half-way through its apply (a step is mostly that); rank 0, which only follows the version.
    Case("shm-async", ("--mode", "async", "--ps-transport", "shm"), "worker", 30000),
    Case("rank0-shm", ("--mode", "async", "--ps-transport", "shm"), "rank0", 30000),
    # ... in its first second after rank 0's start lines: the store's opening follows them within
    # milliseconds (kills 0.02 s after them found it mapped), then the first steps; the opening itself is
    # hit by MPITRAIN_INJECT_KILL=RANK:0:opening (tests/test_shm.py)
    Case("shm-early", ("--mode", "async", "--ps-transport", "shm"), "worker", 8000, window_s=1.0),
    # A worker on another host than the store's (rank 2, MPITRAIN_INJECT_OFFHOST): its gradients come as
    # messages that rank 0 applies into the store; a worker killed (the remote one mid-message, or a local
    # one in the store), or rank 0 killed while it applies
    Case("shm-remote", ("--mode", "async", "--ps-transport", "shm"), "worker", 20000,
         env=("MPITRAIN_INJECT_OFFHOST=2",)),
    Case("rank0-shm-remote", ("--mode", "async", "--ps-transport", "shm"), "rank0", 20000,
         env=("MPITRAIN_INJECT_OFFHOST=2",)),
    # --num-ps 2 on the store: a worker killed between two shards' locks; server rank 1, which only maps it
    Case("shm-2ps", ("--mode", "async", "--ps-transport", "shm", "--num-ps", "2"), "worker", 30000),
    Case("shard-shm", ("--mode", "async", "--ps-transport", "shm", "--num-ps", "2"), "shard", 30000),
    # ... with --local-steps 4: a worker killed while it takes its inner steps or applies its push (an
    # outer step) into the store; rank 0 killed under --on-lost-server continue, the take-over starting from
    # the store's global model and outer momentum
    Case("shm-local", ("--mode", "async", "--ps-transport", "shm", "--local-steps", "4"), "worker", 30000),
    Case("failover-shm-local", ("--mode", "async", "--ps-transport", "shm", "--local-steps", "4", *FAILOVER), "rank0",
         30000),
    # --quorum with --local-steps: a round of 8 inner steps stands for a gradient
    Case("quorum-local", ("--mode", "sync", "--quorum", "2", "--local-steps", "8"), "worker", 8000),
    Case("coordinator-quorum-local", ("--mode", "sync", "--quorum", "2", "--local-steps", "8"), "coordinator", 8000),
    Case("async-2ps", ("--mode", "async", "--num-ps", "2", "--hidden", "2000"), "worker", 1000),
    Case("shard-async", ("--mode", "async", "--num-ps", "2", "--hidden", "2000"), "shard", 1000),
    Case("shard-sync", ("--mode", "sync", "--num-ps", "2"), "shard", 4000),
    # Stops, not crashes: every trial must save, say so in one line, exit 128 + the signal, and resume.
    # (SIGUSR1 is MPICH's own notice of a dead peer under mpirun: Slurm's is tested under srun.)
    Case("term-mpirun-async", ("--mode", "async", "--hidden", "2000"), "launcher", 1200, signal.SIGTERM),
    Case("term-rank-sync", ("--mode", "sync"), "worker", 4000, signal.SIGTERM),
    Case("int-mpirun-quorum", ("--mode", "sync", "--quorum", "2"), "launcher", 2500, signal.SIGINT),
    Case("term-rank0-2ps", ("--mode", "async", "--num-ps", "2"), "rank0", 8000, signal.SIGTERM),
    # A worker joins (the same command with --join, its own mpirun), then is SIGKILLed at a random
    # moment: the job goes on without it as without any worker (MPICH: join.py).
    Case("rejoin-async", ("--mode", "async", "--hidden", "2000"), "joiner", 2400),
    Case("rejoin-sync", ("--mode", "sync"), "joiner", 6000),
    # The checkpoint folder is a small tmpfs that fills up at a random moment (root only): training
    # must finish, say so once, keep the newest good checkpoint, and exit 6 (final one missing).
    Case("disk-full", ("--mode", "sync"), "disk", 4000, 0),
    # --respawn 1 (MPICH and Open MPI): the ranks left start a worker in place of the one killed, which
    # joins at the next step boundary; the budget is finished with it (or first, if the kill came late).
    Case("respawn-async", ("--mode", "async", "--respawn", "1"), "worker", 20000),
    Case("respawn-sync", ("--mode", "sync", "--respawn", "1"), "worker", 4000),
    # ... and the replacement itself killed at a random moment once it joined: async, one server, so it pushes
    # through its mailbox (exchange/mailbox.py); 6.4 MB pushes, so many kills land half-way through writing one
    Case("respawn-mailbox", ("--mode", "async", "--respawn", "1", "--hidden", "2000"), "respawned", 2400),
    # --on-lost-server continue: a worker takes over from the killed rank 0 (failover.py)
    # --spares 1 (both MPIs): a worker killed at any moment is replaced by the waiting spare (world rank NP);
    # the spare itself killed at any moment while it waits, or while it takes a lost worker's place
    # ("spare-joining": a worker killed first, the spare within JOIN_WINDOW_S)
    Case("spare-async", ("--mode", "async", "--spares", "1"), "worker", 20000),
    Case("spare-sync", ("--mode", "sync", "--spares", "1"), "worker", 4000),
    Case("spare-killed", ("--mode", "async", "--spares", "1"), "spare", 20000),
    Case("spare-joining", ("--mode", "async", "--spares", "1"), "spare-joining", 20000),
    Case("failover-sync", ("--mode", "sync", *FAILOVER), "rank0", 4000),
    Case("failover-quorum", ("--mode", "sync", "--quorum", "2", *FAILOVER), "rank0", 2500),
    Case("failover-async", ("--mode", "async", *FAILOVER), "rank0", 20000),
    Case("failover-big", ("--mode", "async", "--hidden", "2000", *FAILOVER), "rank0", 1200),  # mid-message
    Case("failover-shard-async", ("--mode", "async", "--num-ps", "2", "--hidden", "2000", *FAILOVER), "shard", 1000),
    Case("failover-shard-sync", ("--mode", "sync", "--num-ps", "2", *FAILOVER), "shard", 4000),
    # Rank 0 busy with its own duties (a checkpoint and an evaluation every few steps), so that kills at
    # random moments land mid-checkpoint or mid-evaluation often (which share does is not measured).
    Case("failover-duties-sync", ("--mode", "sync", "--checkpoint-every-steps", "10", "--eval-every", "10",
                                  *FAILOVER), "rank0", 1500),
    Case("failover-duties-async", ("--mode", "async", "--checkpoint-every-steps", "40", "--eval-every", "40",
                                   *FAILOVER), "rank0", 8000),
    # --ps-transport shm: the store outlives rank 0, so the take-over loses no update and keeps Adam's state
    Case("failover-shm", ("--mode", "async", "--ps-transport", "shm", "--optimizer", "adam", *FAILOVER), "rank0", 20000),
    # Rank 0 killed while a worker joins (--join, MPICH): before it is let in, while the job makes room
    # or forms the new world with it, or just after
    Case("failover-join", ("--mode", "async", "--hidden", "2000", *FAILOVER), "rank0-join", 2400),
    # ... and while a lost worker is replaced (--respawn 1, both MPIs): a worker killed, then rank 0
    # within 3 s (the loss noticed, the spawn, the new world forming, or just after)
    Case("failover-respawn", ("--mode", "async", "--respawn", "1", *FAILOVER), "rank0-respawn", 20000),
    # ... with --spares 1 (both MPIs): the successor takes the spare over and lets it in at once (spares.adopt)
    Case("failover-spare", ("--mode", "async", "--spares", "1", *FAILOVER), "rank0", 20000),
    Case("failover-spare-sync", ("--mode", "sync", "--spares", "1", *FAILOVER), "rank0", 4000),
    # Issue 80's exchanges: async --local-steps with --overlap (a push in flight while the next H steps run), int8
    # both ways (--compress-replies: rank 0 keeps what each worker holds), and Streaming DiLoCo's three in sync (a
    # fragment's int4 gather in flight): a worker killed, or rank 0 under --on-lost-server continue
    Case("local-overlap", ("--mode", "async", "--local-steps", "4", "--overlap"), "worker", 20000),
    Case("failover-local-overlap", ("--mode", "async", "--local-steps", "4", "--overlap", *FAILOVER), "rank0", 20000),
    Case("int8-both-ways", ("--mode", "async", "--compress", "int8", "--compress-replies"), "worker", 20000),
    Case("failover-int8-both-ways", ("--mode", "async", "--compress", "int8", "--compress-replies", *FAILOVER), "rank0",
         20000),
    Case("streaming", ("--mode", "sync", "--local-steps", "8", "--fragments", "4", "--outer-overlap", "1", "--compress",
                       "int4"), "worker", 12000),
    # sync's reduce-scatter (--compress-replies): each sum compressed again by the worker that adds it; a worker killed
    # in either stage (every step an exchange), and with fragments in flight during the inner steps
    Case("sums", ("--mode", "sync", "--compress", "int2", "--compress-replies"), "worker", 8000),
    Case("streaming-sums", ("--mode", "sync", "--local-steps", "8", "--fragments", "2", "--outer-overlap", "2",
                            "--compress", "int8", "--compress-replies"), "worker", 12000),
]
DEFAULT_TRIALS = {"async": 5, "async-staleness": 4, "async-big": 6, "sync": 4, "sync-quorum": 4, "coordinator-quorum": 3,
                  "quorum-big": 3, "sync-big": 3, "coordinator-sync": 3, "sync-stop": 2, "rank0-async": 4, "rank0-sync": 3, "supervisor": 3, "shm-async": 5, "rank0-shm": 3, "shm-early": 3, "shm-2ps": 3,
                  "shm-remote": 4, "rank0-shm-remote": 3,
                  "shard-shm": 2, "shm-local": 4, "failover-shm-local": 4, "quorum-local": 3, "coordinator-quorum-local": 3, "async-2ps": 4,
                  "shard-async": 3, "shard-sync": 2, "term-mpirun-async": 3, "term-rank-sync": 3,
                  "int-mpirun-quorum": 3, "term-rank0-2ps": 3, "disk-full": 3, "rejoin-async": 4,
                  "rejoin-sync": 3, "respawn-async": 3, "respawn-sync": 3, "failover-sync": 6, "failover-quorum": 4,
                  "failover-async": 6, "failover-big": 4, "failover-shard-async": 5, "failover-shard-sync": 4,
                  "failover-duties-sync": 5, "failover-duties-async": 5, "failover-shm": 5, "failover-join": 6,
                  "failover-respawn": 6, "failover-spare": 6, "failover-spare-sync": 4, "spare-async": 4,
                  "spare-sync": 4, "spare-killed": 4, "spare-joining": 6, "local-overlap": 4, "failover-local-overlap": 4,
                  "int8-both-ways": 4, "failover-int8-both-ways": 4, "streaming": 4, "sums": 5, "streaming-sums": 5}


@dataclass
class Trial:
    case: str
    victim: int | None = None
    kill_after_s: float = 0.0
    outcome: str = "other"
    why: str = ""
    notice_s: float | None = None
    noticed_by: str = ""
    exit_code: int | None = None
    lines: list[str] = field(default_factory=list)
    lost_updates: int | None = None  # --on-lost-server continue: the take-over's updates_lost_at_most
    joiner_code: int | None = None  # rank0-join: how the joiner's own mpirun ended
    accuracy: float | None = None  # ... and the final test accuracy


def command(case: Case, tmp: str) -> list[str]:
    spawns = "--respawn" in case.args  # Open MPI: its shared memory alone does not reach a spawned process
    return [mpirun(), *IMPL.keep_going, *mpiimpl.local_flags(IMPL, spawns), "-np", str(NP + case.spares),
            *(("env", *case.env) if case.env else ()), sys.executable, "-m", "mpitrain",
            *BASE, *case.args,
            "--steps", str(case.steps), "--checkpoint-dir", os.path.join(tmp, "ck"),
            "--summary-json", os.path.join(tmp, "summary.json")]


def join_command(case: Case, tmp: str) -> list[str]:
    """The job's own command under its own mpirun -np 1, with --join (README, "A worker joins")."""
    return [mpirun(), *mpiimpl.local_flags(IMPL), "-np", "1", sys.executable, "-m", "mpitrain", *BASE, *case.args,
            "--steps", str(case.steps), "--checkpoint-dir", os.path.join(tmp, "ck"), "--join"]


def failover(case: Case) -> bool:
    return "--on-lost-server" in case.args and case.args[case.args.index("--on-lost-server") + 1] == "continue"


def goes_on(case: Case) -> bool:
    """A lost worker is dropped and the job finishes its budget with the others: async, and sync
    (--quorum too) unless --on-lost-worker stop or --num-ps K (README, Elastic)."""
    return "stop" not in case.args and (case.mode == "async" or "--num-ps" not in case.args)
