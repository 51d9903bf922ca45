"""Ends MPICH's mpiexec when it is left waiting for a host it cannot reach (issue 50: a partition).

Measured with two network-namespace hosts (rank 0 and a worker on A, two workers on B, async,
`-disable-auto-cleanup`, B's link cut 4 s in): rank 0 declared B's workers lost, trained to its
budget with the worker beside it and wrote its summary; B's ranks lost rank 0 and ended; every rank
and both proxies were gone, and hydra's mpiexec still waited for B's proxy, whose end it can no
longer hear, for good (100 s and counting; under Slurm such a job keeps its allocation until its
time limit). SIGTERM ends it (its exit code 255).

So a rank that leaves after a lost peer under hydra starts this watcher (a new session, stdio
closed): when mpiexec is this rank's ancestor (it ran on this host) and for GRACE_S it has had no
proxy left on this host (every rank here has ended) and still not exited, the only processes it
waits for are on hosts it cannot reach. It writes one line to mpiexec's own stderr, where the
user reads the job's output, and sends mpiexec SIGTERM. One watcher per mpiexec (a lock file), and
none where mpiexec exits by itself, as it does after a lost peer on a reachable host.

    python -m mpitrain.reaper MPIEXEC_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpitrain.samehost import stat_fields

# mpiexec alone on this host this long: what it waits for is out of reach (the partition test sets it lower)
GRACE_S = float(os.environ.get("MPITRAIN_REAPER_GRACE_S", "20"))
GIVE_UP_S = 3600.0  # a watcher never outlives this
POLL_S = 1.0
LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun")  # hydra's front end, as /proc/PID/comm names it
PROXY = "hydra_pmi_prox"  # hydra_pmi_proxy, as /proc/PID/comm truncates it (15 characters)


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()




def _parent(pid: int) -> int:
    return int(stat_fields(pid)[1])


def launcher_above(pid: int, levels: int = 6) -> int | None:
    """The hydra mpiexec among this process's ancestors (rank -> supervisor -> proxy -> mpiexec), or
    None: it runs on another host (or the launcher is not hydra's)."""
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


def proxies_here(launcher: int) -> bool:
    """Whether mpiexec still has a proxy on this host (a rank here may still be running)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = stat_fields(int(entry))
                if int(stat[1]) == launcher and stat[0] not in "ZX" and _comm(int(entry)).startswith(PROXY):
                    return True  # (an exited one not reaped yet is no proxy)
            except (OSError, ValueError, IndexError):
                continue
    return False


def start(env=os.environ) -> None:
    """A rank leaving after a lost peer: the watcher, when hydra's mpiexec runs on this host."""
    from mpitrain.mpiimpl import hydra_env

    launcher = launcher_above(os.getpid()) if hydra_env(env) else None
    if launcher is None:
        return
    try:
        subprocess.Popen([sys.executable, "-m", "mpitrain.reaper", str(launcher)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        pass  # no watcher: mpirun ends as it always did (by itself, or by hand)


def watch(launcher: int, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Until mpiexec exits, or has been alone on this host for GRACE_S: then its line and SIGTERM.
    True when it was ended here."""
    started = alone_since = clock()
    while clock() - started < GIVE_UP_S:
        try:
            if _comm(launcher) not in LAUNCHERS or stat_fields(launcher)[0] in "ZX":
                return False  # it exited (a zombie not reaped yet, or the pid another process's by now)
        except (OSError, IndexError):
            return False
        now = clock()
        if proxies_here(launcher):
            alone_since = now
        elif now - alone_since >= GRACE_S:
            _tell(launcher, f"mpitrain: mpirun was still waiting {GRACE_S:g} s after every rank on this host had "
                            f"ended: the ranks it waits for are on a host it cannot reach (a network partition, or a "
                            f"host that went down), and their end never reaches it; ending it (exit 255, mpirun's). "
                            f"The job's summary and checkpoints above are complete\n")
            os.kill(launcher, signal.SIGTERM)
            return True
        sleep(POLL_S)
    return False


def _tell(pid: int, line: str) -> None:
    """One line on mpiexec's own stderr: where the job's output goes (a terminal, a batch log)."""
    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    try:
        os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    launcher = int(argv[0])
    lock = Path(f"/tmp/.mpitrain-reaper-{launcher}")
    try:  # one watcher per mpiexec (every rank of this host that lost a peer starts one)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except OSError:
        return 0
    try:
        watch(launcher)
    finally:
        lock.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
