"""Under MPICH's hydra launcher, run each rank as the child of a tiny supervisor process.

Why (measured with MPICH 5.0.2, see docs/lost-ranks.md): hydra's proxy reaps its children with
waitpid, and when one was *killed by a signal* it SIGKILLs every other rank -- even under
`mpirun -disable-auto-cleanup`, at the proxy's next event (any output or exit of a survivor).
So a worker killed by the OOM killer or `kill -9` would take the whole job down with it. With a
supervisor in between, hydra's child is the supervisor, which *exits* (killed_exit) instead
of being killed; hydra then only notifies the survivors (SIGUSR1, which we ignore) and, under
-disable-auto-cleanup, leaves them running, so rank 0 can finish with the remaining workers.

Without -disable-auto-cleanup nothing changes for the user: the rank's death closes its PMI
socket, hydra SIGKILLs the supervisors, and the kernel kills their ranks with them
(PR_SET_PDEATHSIG), so the whole job still ends at once. A supervisor dies with hydra's proxy the same way.

The supervisor is the same process forked before MPI is initialised (no second interpreter
start). MPITRAIN_SUPERVISE=0 turns it off (mpiimpl.needs_supervisor). Open MPI's prterun needs
none: under `--with-ft ulfm` it keeps the others running however a rank died.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from mpitrain.launch.mpiimpl import ignore_death_notices, needs_supervisor
from mpitrain.launch.samehost import stat_fields

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15
WAIT_S = 0.05  # the supervisor looks at its rank this often (_wait_for)
ANSWER_S = 0.5  # a rank killed where hydra may owe it an answer: its PMI socket held so long (_let_answers_land)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2, signal.SIGCONT)


def supervise() -> None:
    """Fork. The child returns and becomes the MPI rank; the parent never returns: it waits for
    the child and exits with its status."""
    if not sys.platform.startswith("linux") or not needs_supervisor():
        return
    parent = os.getpid()
    rank = os.environ.get("PMI_RANK", "")
    # Blocked across the fork: a signal that reaches the supervisor before its forwarding
    # handlers are installed stays pending instead of killing it (measured: a SIGTERM sent as soon
    # as the rank printed found the supervisor still starting up, and it died of it).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    # Hydra's SIGUSR1 ("a peer died"): ignored from here on, in both processes (a replacement importing
    # while rank 0 spawned it died of its default before MPI_Init).
    ignore_death_notices()
    # The title lives in the command line's own bytes (_name): the interpreter's path gives its room
    # to the words that say which rank this is, and the arguments follow as far as they fit.
    command = " ".join(sys.orig_argv[1:])
    who = "spawned worker" if os.environ.get("PMI_SPAWNED") == "1" else f"rank {rank}"
    started_r, started_w = os.pipe()  # the rank's word that its start-up is over (started())
    # Named before the fork, so that nobody (ps, a test) ever sees the supervisor under the plain command
    # line once its rank runs: named after, a look from the rank at its parent could come first (CI, once).
    _name(f"mpitrain {who} supervisor: {command}", f"mpitrain-sup{rank}")
    # It dies with its parent, hydra's proxy, and its rank with it (the rank's own _die_with, below): a proxy
    # killed with mpiexec (`pkill -9`, the OOM killer) cannot end the ranks, which spun on for good.
    _die_with(os.getppid())
    pid = os.fork()
    if pid == 0:
        global _started_fd
        os.close(started_r)
        _started_fd = started_w
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        _die_with(parent)
        _name(f"mpitrain {who} training: {command}", f"mpitrain-rank{rank}")
        # The rank keeps every signal's default but hydra's SIGUSR1 ("a peer died"), which reaches each
        # supervisor's process group, the rank in it: the supervisor and the rank (once MPI is up:
        # mpiimpl.ignore_death_notices) ignore it.
        return
    os.close(started_w)
    _wait_for(pid, started_r)


_started_fd: int | None = None  # the rank's end of the pipe to its supervisor (None: no supervisor)


def started() -> None:
    """The rank: start-up is over (its heartbeats run: trainer.py), so the job can go on without it
    from here, and a kill is a lost rank as documented. Before, the others wait for it in the
    start-up collectives (MPI_Init, the setup agreement, the first broadcast), where MPICH never
    notices a dead peer: the job hung (issue 82). A rank killed before saying this takes the whole
    job down instead (killed_during_start_up)."""
    global _started_fd
    if _started_fd is None:
        return
    try:
        os.write(_started_fd, b"1")
        os.close(_started_fd)
    except OSError:
        pass
    _started_fd = None


def _word(started_r: int) -> bool | None:
    """The rank's word on its start-up: True (over), False (its end of the pipe closed without it: it
    died or exited in start-up), None (not yet: the pipe's write end is still open)."""
    os.set_blocking(started_r, False)
    try:
        return os.read(started_r, 1) == b"1"
    except BlockingIOError:
        return None


def _name(title: str, name: str) -> None:
    """What `ps aux` shows (the title: `mpitrain rank 2 supervisor: python -m mpitrain ...`, where the
    two processes once had the same command line, issue 77) and the name that `ps -o comm`, `top`
    and `pkill -x` show (15 bytes at most), so that a user can tell the training process from its
    supervisor (README: "When things go wrong")."""
    import ctypes

    # In the command line's own bytes only (a long title is cut at its end): by default setproctitle
    # also writes over the environment's, and /proc/PID/environ (read by the fault tests' tools,
    # faults.rank_pids, and by anyone who debugs a rank) would then show the title.
    os.environ["SPT_NOENV"] = "1"
    from setproctitle import setproctitle

    setproctitle(title)  # before the name: it sets the name too, cut to 15 bytes
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _die_with(parent: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _wait_for(pid: int, started_r: int) -> None:
    # hydra's proxy learns of the rank's end when its PMI socket closes (the proxy's end reads EOF): under
    # the keep-going flag it then tells mpiexec, which signals every other launch's proxy (a replacement's
    # is one), and mpiexec died of SIGPIPE (-13, 141 in a shell) when that proxy had just exited. So the
    # supervisor holds its copy of the socket: a rank killed by a signal has it closed once any answer
    # hydra may have owed it has landed (_let_answers_land), a rank that exited has it held until its
    # proxy is gone (_hold_past_the_proxy): hydra hears of no plain exit through it.
    pmi_fd = int(os.environ["PMI_FD"])
    started = None
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # The forwarded signals stay blocked (since before the fork) and are taken here one by one with
    # sigtimedwait, which also paces the look at the rank: no Python-level handler. With handlers (run
    # only when the main thread comes back to the interpreter, after the C handler's flag), a SIGTERM
    # to the supervisor twice never reached its rank, in CI under Open MPI's suite: the rank slept its
    # 30 s out, exit 0 for 7 (once behind a blocking waitpid, once behind this loop's time.sleep).
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if started is None:
            started = _word(started_r)
        caught = signal.sigtimedwait(FORWARDED, WAIT_S)
        if caught is not None:
            _forward(pid, caught.si_signo)
    if started is None:
        started = _word(started_r)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # A process the job spawned (--respawn) is rank 0 of its own launch: its PMI_RANK would name
        # the job's rank 0, which is alive (rank 0's own line names the rank it had in the job).
        spawned = os.environ.get("PMI_SPAWNED") == "1"
        who = "a worker the job started" if spawned else f"rank {os.environ.get('PMI_RANK', '?')}"
        # (None: a fork of the rank still holds the pipe's write end: no word either way, and the job goes
        # on as it did before start-ups were told apart.) A spawned one's start-up is the job's to handle.
        if not spawned and started is False:
            killed_during_start_up(who, pid, sig, pmi_fd)
        os.write(2, f"mpitrain: {who} (pid {pid}) was killed by signal {sig} "
                    f"({signal.Signals(sig).name})\n".encode())
        rank_0 = not spawned and os.environ.get("PMI_RANK") == "0"
        # Held only where hydra may owe an answer: a start-up, or rank 0, which spawns replacements. A worker
        # killed mid-run asked hydra nothing, and its death is told at once, as rank 0's spawn waits for
        # (respawn.AFTER_LOSS_S: a notice during a replacement's start-up killed it, and hydra the job, 2 in 10).
        if started is False or rank_0:
            _let_answers_land(pmi_fd)
        else:
            _told_before_exit(pmi_fd)
        os.close(pmi_fd)
        os._exit(killed_exit(sig, rank_0=rank_0))
    _hold_past_the_proxy(pmi_fd)
    os._exit(os.waitstatus_to_exitcode(status))


def _hold_past_the_proxy(pmi_fd: int) -> None:
    """The rank exited: its PMI socket held, in a forked child, until this supervisor's parent (hydra's
    proxy) is gone. Measured (MPICH 5.0.2, a job with a replacement, hydra's proxy and mpiexec stopped as
    the ranks ended, the proxy let go first): the ranks' closed sockets became notices that mpiexec read
    after the proxy had exited, and it died of SIGPIPE writing to it, 3 of 3; with the sockets held, no
    notice, exit 8 (tests/test_respawn.py). Its output is not held: the proxy ends once every rank's is
    closed."""
    from mpitrain.launch.reaper import PROXY, _comm

    proxy = os.getppid()
    try:
        under_hydra = _comm(proxy).startswith(PROXY)
    except OSError:
        under_hydra = False  # (not under hydra's proxy: a test's hand-made environment)
    if under_hydra:
        _hold_until_gone(proxy, keep=(pmi_fd,), limit_s=3600.0, every_s=0.01)


def killed_during_start_up(who: str, pid: int, sig: int, pmi_fd: int | None = None) -> None:
    """The rank died before its start-up was over: the others wait for it in a collective that MPICH
    never ends. Dying by the same signal makes hydra end every rank at once, as a default `mpirun`
    does when a rank dies (the job had trained nothing yet; the same command starts it again)."""
    os.write(2, f"mpitrain: {who} (pid {pid}) was killed by signal {sig} ({signal.Signals(sig).name}) during "
                f"start-up, before the job could go on without it; ending the job (the same command starts it "
                f"again)\n".encode())
    from mpitrain.launch import reaper

    reaper.start(why="start-up")  # hydra's mpiexec once waited on with no rank left (1 kill in 30)
    _let_answers_land(pmi_fd)
    _hold_output_past_death()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to take back)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal that does not end a process (SIGCONT, ...) cannot have killed the rank


def _let_answers_land(pmi_fd: int | None, limit_s: float = ANSWER_S) -> None:
    """Hold the dead rank's PMI socket open a moment longer, reading what hydra still sends it.

    Why (MPICH 5.0.2, proxy/pmip_cb.c): a rank killed while hydra owed it an answer (a KVS `get` sent on
    to mpiexec, a barrier's end: MPI_Init is made of them; a spawn) breaks hydra's proxy. Seeing the
    socket's EOF, the proxy closes its end at once; the answer then comes and its write fails (EBADF, or
    SIGPIPE on a socket whose peer is gone), the proxy exits and mpiexec with it (255), every rank killed
    and this supervisor's line lost (clean-clone CI, once, a worker killed in start-up). Held here, the
    answer lands in a socket nobody reads; the proxy sees the EOF when this process ends, after it.
    Only a rank killed by a signal is waited for: one that exits has had every answer it asked for."""
    if pmi_fd is None:
        return
    import select

    watch = select.poll()
    watch.register(pmi_fd, select.POLLIN)
    deadline = time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0:
        if watch.poll(left * 1000) and not _drained(pmi_fd):
            return  # the proxy closed its end: it owes nothing more


def _told_before_exit(pmi_fd: int, limit_s: float = ANSWER_S) -> None:
    """A worker killed mid-run: its death told to hydra's proxy now (the socket's EOF), and this supervisor's
    exit 0 only once the proxy has taken it in (it closes its end on the EOF). Closed and exited at once, the
    proxy could reap the exit first and take the EOF after it for a process that ended well: without
    -disable-auto-cleanup the job then went on without the worker instead of ending (clean-clone CI
    2026-12-07: a sync job finished its 100,000 steps on one worker, no line from hydra)."""
    import socket

    try:
        sock = socket.socket(fileno=pmi_fd)
        try:
            sock.shutdown(socket.SHUT_WR)
        finally:
            sock.detach()
    except OSError:
        return
    _let_answers_land(pmi_fd, limit_s)


def _drained(fd: int) -> bool:
    """Read what is there; False at the end of the stream (or a socket that cannot be read)."""
    try:
        return bool(os.read(fd, 4096))
    except OSError:
        return False


def _hold_output_past_death() -> None:
    """Keep this supervisor's stdout and stderr open, in a forked child, until the supervisor is a zombie.

    Why: hydra's proxy calls waitpid(WNOHANG) once per event it sees (proxy/pmip.c) and ends every rank
    only when that call finds a child killed by a signal. The supervisor's own death closes its output
    pipes, the proxy's last event, and the kernel closes a dying process's files before it makes it a
    zombie: a proxy quick enough looked before and found nothing, and then waited for good while the
    others spun in a start-up collective (CI, once; 1 kill in 12 at 0.7-1.2 s, reproduced). Closed here
    only once the supervisor is a zombie, the pipes' end is an event after which waitpid finds it."""
    _hold_until_gone(os.getpid(), keep=(0, 1, 2), limit_s=10.0, every_s=0.005)


def _hold_until_gone(pid: int, keep: tuple[int, ...], limit_s: float, every_s: float) -> None:
    """Fork a child that keeps only the descriptors `keep` open until process `pid` is a zombie or gone
    (or `limit_s` has passed); the caller returns at once. Its exit closes them: the event they stand for
    (an EOF, the end of an output) comes after `pid`'s end, never before."""
    if os.fork() != 0:
        return
    try:  # the child: nothing of Python's beyond os, and never back into the caller
        low = 0
        for fd in sorted(keep):
            if low < fd:  # (os.closerange(0, 0) closes every descriptor: close_range(0, -1 as unsigned))
                os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 4096)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not _dead(pid):
            time.sleep(every_s)
    finally:
        os._exit(0)


def _dead(pid: int) -> bool:
    """A zombie, or reaped already."""
    try:
        return stat_fields(pid)[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def killed_exit(sig: int, rank_0: bool) -> int:
    """The supervisor's exit code when its rank was killed by `sig`. Hydra's mpirun exits with the OR
    of every rank's code, and 128 + 9 = 137 holds the bits of rank 0's verdicts (8: done without the
    lost worker; 5: stopped on it), so a worker's 137 made every survived loss read as 137, an OOM
    kill to Slurm (issue 77). Rank 0 decides the job's code: a worker's supervisor says its line and
    exits 0. Rank 0's passes its death on (128 + sig), so that a job whose ranks were all killed never
    reads as done; after rank 0's take-over (--on-lost-server continue) the job's code is thus 137."""
    return 128 + sig if rank_0 else 0


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass

