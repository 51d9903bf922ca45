"""A peer on this host whose process has ended is lost at once, not --worker-timeout later.

MPICH does not tell the others when a rank is SIGKILLed in the middle of shared-memory traffic: a
sync Allreduce then waits until the heartbeats fall silent (--worker-timeout), every rank idle,
which was most of what each kill cost a job under repeated failures (benchmarks/GOODPUT.md). But
a peer on the same host can be looked at directly: each heartbeat carries who sent it (pid, the
process's start time, a key of the kernel's boot and the pid namespace: `identity`), and the watch
looks in /proc for each peer that shares its key (`ended`). A pid that no longer exists, one that
names another process now (a different start time), or a zombie, is a peer that has ended.

Only where the key matches: another host, another container's pid namespace, or no /proc, and the
heartbeat timeout is all there is, as before. A process stopped (SIGSTOP) or frozen is alive here:
that is the timeout's case too.
"""

from __future__ import annotations

import hashlib
import os

KEY_BITS = 52  # the key travels in a float64 beat field: exact below 2**53


def stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses): state,
    ppid, pgrp, session, ..., start time at [19] (stat(5) fields 3 on). The one reader of it (the
    folder lock, the reaper and the fault tools use it too); raises OSError for a process that is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().decode(errors="replace").rsplit(")", 1)[1].split()


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, or None if there is none."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[19])


def _host_key() -> int:
    """This kernel's boot and this pid namespace: equal keys, equal meaning of a pid. 0: unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
    digest = hashlib.blake2b(boot + b":" + str(ns).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << KEY_BITS) - 1) or 1


def identity() -> tuple[float, float, float]:
    """(pid, start time, host key) of this process, as a heartbeat carries them; zeros where /proc
    cannot say (a peer then never looks)."""
    try:
        me = _stat("self")
    except (OSError, ValueError, IndexError):
        me = None
    key = _host_key()
    if me is None or not key:
        return 0.0, 0.0, 0.0
    return float(os.getpid()), float(me[1]), float(key)


_MINE: dict[int, tuple[float, float, float]] = {}


def mine() -> tuple[float, float, float]:
    """This process's identity, read once (per pid: the supervisor forks the rank after imports)."""
    pid = os.getpid()
    if pid not in _MINE:
        _MINE[pid] = identity()
    return _MINE[pid]


UNKNOWN = "unknown"  # _look: not ours to look at, or unreadable now


def _look(peer: tuple[float, float, float]) -> str | tuple[str, int] | None:
    """The process a peer's heartbeat named, as /proc shows it now: (state, start time) while it is the
    same process, None once it is gone or another process has its pid, UNKNOWN where this host cannot
    say (another host or pid namespace, an identity of zeros, /proc unreadable: a race with its exit)."""
    pid, started, key = (int(x) for x in peer)
    if not pid or not key or key != int(mine()[2]):
        return UNKNOWN
    try:
        now = _stat(pid)
    except (OSError, ValueError, IndexError):
        return UNKNOWN
    return now if now is not None and now[1] == started else None


def ended(peer: tuple[float, float, float]) -> str | None:
    """Why the process a peer's heartbeat named has ended, or None: alive, or not ours to look at
    (another host or pid namespace, or an identity of zeros; unreadable: ask again later)."""
    now, pid = _look(peer), int(peer[0])
    if now is None:
        return f"its process (pid {pid}) has ended"
    if now != UNKNOWN and now[0] in "ZXx":
        return f"its process (pid {pid}) has exited"
    return None


def alive(peer: tuple[float, float, float]) -> bool:
    """Whether the process a peer's heartbeat named certainly still runs: on this host (its key), the
    same process (its start time), not a zombie; stopped (SIGSTOP) or frozen counts as running."""
    now = _look(peer)
    return now is not None and now != UNKNOWN and now[0] not in "ZXx"
