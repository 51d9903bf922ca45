"""One owner per output folder: a job takes a lock in --checkpoint-dir and --log-dir before it
touches them, so two jobs (or the same job started twice) never interleave one events.jsonl or
overwrite each other's checkpoints.

The lock is a file, `.mpitrain.lock`, created with O_EXCL and holding who owns it (host, pid, the
process's start time, the Slurm job id, when). It is removed on every way out of a run that Python
sees (trainer.run's end, exit_without_finalize, before MPI_Abort). A SIGKILL leaves it behind:
the next job takes it over, saying so, when its owner is provably gone: a process of this host
that no longer exists (pid and start time: a reused pid is another process), or an earlier
incarnation of the same Slurm job (a requeue restarts the job under its old id, possibly on
another node). A lock held by a live process, or by another host's process, refuses the job in one
line naming the owner and the fix.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from mpitrain.core.config import UsageError
from mpitrain.launch import samehost

NAME = ".mpitrain.lock"
HELD: list["FolderLock"] = []  # locks this process holds, released by release_all()


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None
    when there is no such process, or only its zombie (killed, not yet reaped)."""
    try:
        stat = samehost.stat_fields(pid)
    except OSError:
        return None
    return None if stat[0] in ("Z", "X") else stat[19]


def owner_record() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "proc_start": _proc_start(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def owner_gone(owner: dict, me: dict) -> str | None:
    """Why the lock's owner is certainly not running any more, or None if it may be."""
    if owner.get("slurm_job_id") and owner.get("slurm_job_id") == me.get("slurm_job_id"):
        return f"an earlier run of Slurm job {owner['slurm_job_id']} (requeued)"
    if owner.get("host") != me["host"]:
        return None  # another host: nothing here can tell whether it still runs
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return "an unreadable owner"
    start = _proc_start(pid)
    if start is None or (owner.get("proc_start") is not None and start != owner["proc_start"]):
        return f"pid {pid} on this host, which has ended"
    return None


class FolderLock:
    def __init__(self, flag: str, directory: Path):
        self.flag, self.dir = flag, Path(directory)
        self.path = self.dir / NAME
        self.record = owner_record()
        self.took_over: str | None = None  # why a stale lock was taken over

    def acquire(self) -> str | None:
        """Take the lock; the line to print when a stale one was taken over. UsageError when the
        folder is someone else's."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{self.flag} {self.dir} cannot be created ({e.strerror}); pick a folder you can "
                             f"write to") from None
        for _ in range(3):  # a takeover races with another job's: re-check after each step
            try:
                self._create()
            except FileExistsError:
                owner = self._read()
                if owner == {}:
                    continue  # released meanwhile
                why = owner_gone(owner, self.record) if owner is not None else "an unreadable lock file"
                if why is None:
                    raise UsageError(
                        f"{self.flag} {self.dir} is in use by another mpitrain job (host {owner.get('host')}, "
                        f"pid {owner.get('pid')}, started {owner.get('started')}): wait for it to end or use "
                        f"another folder; if that job is gone, delete {self.path}") from None
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                self.took_over = why
                continue
            except OSError as e:  # read-only, no permission, or full (a quota): certain now
                raise UsageError(f"{self.flag} {self.dir} is not writable ({e.strerror}); free space or pick a "
                                 f"folder you can write to") from None
            HELD.append(self)
            why = self.took_over
            return f"mpitrain: {self.flag} {self.dir}: took over the stale lock of {why}" if why else None
        raise UsageError(f"{self.flag} {self.dir}: another job keeps taking its lock; use another folder")

    def _create(self) -> None:
        """The lock file with its owner inside, or FileExistsError: written beside it first, then
        hard-linked into place, so no other job ever reads a lock half-written (and takes it)."""
        tmp = self.dir / f".{NAME}.{self.record['pid']}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.record, f)
            os.link(tmp, self.path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _read(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}  # released meanwhile: try again
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def release(self) -> None:
        """Remove the lock if it is still this process's (never another job's)."""
        if self in HELD:
            HELD.remove(self)
        try:
            if json.loads(self.path.read_text()).get("pid") == self.record["pid"]:
                os.unlink(self.path)
        except (OSError, ValueError):
            pass


def acquire_folders(folders: list[tuple[str, str | None]]) -> list[str]:
    """Lock each distinct folder named by a flag (None: not given). Returns the lines to print.
    On a refusal the locks already taken are released."""
    lines, seen = [], set()
    try:
        for flag, path in folders:
            if path is None:
                continue
            key = Path(path).expanduser().resolve()
            if key in seen or any(held.dir.expanduser().resolve() == key for held in HELD):
                continue  # named twice, or this process holds it already (the next phase of a job a worker joined)
            seen.add(key)
            line = FolderLock(flag, Path(path)).acquire()
            if line:
                lines.append(line)
    except UsageError:
        release_all()
        raise
    return lines


def release_all() -> None:
    for lock in list(HELD):
        lock.release()


def exit_without_finalize(code: int) -> None:
    """End this rank now. After a peer is lost MPI_Finalize would wait for it forever (measured
    with MPICH 5.0.2), so the survivors leave without it; os._exit would neither release this
    process's folder locks nor flush its output, so those come first. Here, beside the locks, so
    that join.py (which trainer imports) ends a stuck re-forming the same way. A peer on a host that
    cannot be reached any more would leave hydra's mpiexec waiting for good: reaper.py watches it."""
    from mpitrain.launch import reaper

    spares = sys.modules.get("mpitrain.membership.spares")  # loaded: a job with --spares, whose MPI is up
    if spares is not None:
        spares.dismiss_all(peer_lost=True)  # rank 0's: they would wait for its beats until spares.quiet_s
    release_all()
    reaper.start()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
