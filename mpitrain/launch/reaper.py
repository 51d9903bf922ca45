"""Ends the launcher when it is left waiting for a host it cannot reach (issue 50: a partition).

Measured with two network-namespace hosts (rank 0 and a worker on A, two workers on B, async,
`-disable-auto-cleanup`, B's link cut 4 s in): rank 0 declared B's workers lost, trained to its
budget with the worker beside it and wrote its summary; B's ranks lost rank 0 and ended; every rank
and both proxies were gone, and hydra's mpiexec still waited for B's proxy, whose end it can no
longer hear, for good (100 s and counting; under Slurm such a job keeps its allocation until its
time limit). SIGTERM ends it (its exit code 255). Open MPI's prterun (`--with-ft ulfm`) does the
same: every rank gone, it waited for B's prted 120 s and counting (2026-11-27). So does the reverse
(rank 0 and a worker on B, cut off from mpirun's host A): A's workers lose rank 0 and end, rank 0
finishes the job on B, and mpirun on A waits.

So a rank that leaves after a lost peer starts this watcher (a new session, stdio closed): when the
launcher is this rank's ancestor (it ran on this host) and for GRACE_S it has had no rank left on
this host (hydra: no proxy; prterun: no child with a PMIx rank) and still not exited, the only
processes it waits for are on hosts it cannot reach. It writes one line to the launcher's own
stderr, where the user reads the job's output, and sends it SIGTERM. One watcher per launcher (a
lock file), and none where the launcher exits by itself, as it does after a lost peer on a
reachable host or once a partition heals (measured: B's link back 10 s after the cut, hydra heard
B's ranks end and exited by itself, 13 = rank 0's 8 | the workers' 5).

    python -m mpitrain.launch.reaper LAUNCHER_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpitrain.launch.samehost import stat_fields

# mpiexec alone on this host this long: what it waits for is out of reach (the partition test sets it lower)
GRACE_S = float(os.environ.get("MPITRAIN_REAPER_GRACE_S", "20"))
GIVE_UP_S = 3600.0  # a watcher never outlives this
POLL_S = 1.0
# How the launcher is ended, each signal given so many seconds. hydra's mpiexec ends on SIGTERM. Open
# MPI's prterun does not (it waits to take down the daemon it cannot reach: measured, a second SIGTERM
# did nothing either); a second SIGINT within a moment ends it, as Ctrl-C twice does at a terminal.
END_SIGNALS = ((signal.SIGTERM, 5.0), (signal.SIGINT, 0.5), (signal.SIGINT, 5.0), (signal.SIGKILL, 5.0))
# hydra's front end and Open MPI's (its mpirun execs prterun), as /proc/PID/comm names them
LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "prterun")
PROXY = "hydra_pmi_prox"  # hydra_pmi_proxy, as /proc/PID/comm truncates it (15 characters)
PMIX_RANK = b"PMIX_RANK="  # in the environment of each rank prterun starts on its own host


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _parent(pid: int) -> int:
    return int(stat_fields(pid)[1])


def launcher_above(pid: int, levels: int = 6) -> int | None:
    """The launcher among this process's ancestors (hydra: rank -> supervisor -> proxy -> mpiexec;
    Open MPI: rank -> prterun), or None: it runs on another host (or under another launcher: srun)."""
    try:
        for _ in range(levels):
            pid = _parent(pid)
            if pid <= 1:
                return None
            if _comm(pid) in LAUNCHERS:
                return pid
    except (OSError, ValueError, IndexError):
        return None
    return None


def ranks_here(launcher: int) -> bool:
    """Whether the launcher still has a rank on this host: hydra's through its local proxy, prterun's
    as its own children (its children on other hosts are daemons started over ssh: no PMIx rank)."""
    for pid, _ in _children(launcher):
        try:
            if _comm(pid).startswith(PROXY) or _is_rank(pid):
                return True
        except OSError:
            continue
    return False


def _children(launcher: int) -> list[tuple[int, str]]:
    """The launcher's live children on this host, as (pid, start time); an exited one not reaped yet is gone."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = stat_fields(int(entry))
                if int(stat[1]) == launcher and stat[0] not in "ZX":
                    out.append((int(entry), stat[19]))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _is_rank(pid: int) -> bool:
    return any(var.startswith(PMIX_RANK) for var in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))


def start(env=os.environ, why: str = "partition") -> None:
    """A rank leaving after a lost peer: the watcher, when the job's launcher runs on this host. `why`
    "start-up": a supervisor whose rank died in start-up (hydra's mpiexec was once left waiting with no
    rank and no proxy left, 1 kill in 30: benchmarks/STARTUP_KILLS.md)."""
    from mpitrain.launch.mpiimpl import hydra_env

    under_a_launcher = hydra_env(env) or "OMPI_COMM_WORLD_RANK" in env  # (srun's ranks have no launcher above)
    launcher = launcher_above(os.getpid()) if under_a_launcher else None
    if launcher is None:
        return
    try:
        subprocess.Popen([sys.executable, "-m", "mpitrain.launch.reaper", str(launcher), why], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        pass  # no watcher: mpirun ends as it always did (by itself, or by hand)


WHY = {"partition": "the ranks it waits for are on a host it cannot reach (a network partition, or a host that went "
                     "down), and their end never reaches it; ending it. Rank 0 finishes the job on whichever side it "
                     "is, and its summary and checkpoints are complete where its host writes them",
       "start-up": "a rank died while the job started, and the launcher missed the end of the others; ending it "
                   "(the same command starts the job again)"}


def watch(launcher: int, clock=time.monotonic, sleep=time.sleep, why: str = "partition") -> bool:
    """Until mpiexec exits, or has been alone on this host for GRACE_S: then its line and SIGTERM.
    True when it was ended here."""
    started = alone_since = clock()
    while clock() - started < GIVE_UP_S:
        if _gone(launcher):
            return False
        now = clock()
        if ranks_here(launcher):
            alone_since = now
        elif now - alone_since >= GRACE_S:
            _tell(launcher, f"mpitrain: mpirun was still waiting {GRACE_S:g} s after every rank on this host had "
                            f"ended: {WHY[why]}\n")
            left = _children(launcher)  # no rank is left: its agents (ssh sessions) to the host it cannot reach
            for signum, wait in END_SIGNALS:
                os.kill(launcher, signum)
                if _ended(launcher, wait, clock, sleep):
                    break
            _end_left(left)
            return True
        sleep(POLL_S)
    return False


def _gone(launcher: int) -> bool:
    """Whether the launcher has exited (a zombie not reaped yet, or the pid another process's by now)."""
    try:
        return _comm(launcher) not in LAUNCHERS or stat_fields(launcher)[0] in "ZX"
    except (OSError, IndexError):
        return True


def _ended(launcher: int, wait: float, clock, sleep) -> bool:
    """Whether the launcher ends within `wait` s."""
    deadline = clock() + wait
    while clock() < deadline:
        if _gone(launcher):
            return True
        sleep(POLL_S / 10)
    return False


def _end_left(left: list[tuple[int, str]]) -> None:
    """SIGTERM what the launcher left of its children (an ssh session to the lost host would hold
    mpirun's output open: `mpirun ... | tee` would not end), each checked to be the same process (its
    start time) first."""
    for pid, started in left:
        try:
            if stat_fields(pid)[19] == started:
                os.kill(pid, signal.SIGTERM)
        except (OSError, IndexError):
            continue


def _tell(pid: int, line: str) -> None:
    """One line on mpiexec's own stderr: where the job's output goes (a terminal, a batch log). Never waited
    for: a pipe whose reader stopped reading (a test's, a wrapper's) would have held the watcher for good."""
    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    launcher, why = int(argv[0]), (argv[1:] or ["partition"])[0]
    lock = Path(f"/tmp/.mpitrain-reaper-{launcher}")
    try:  # one watcher per mpiexec (every rank of this host that lost a peer starts one)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except OSError:
        return 0
    try:
        watch(launcher, why=why if why in WHY else "partition")
    finally:
        lock.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
