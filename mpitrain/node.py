"""This process's MPI world and the host it runs on: MPI initialised as every rank needs it (`world`), what
the node holds (`Node`, `node_info`: ranks here, cores, the ranks another launch started here), and the
clean-up of the init segments a killed job would leave in /dev/shm. Collective, at set-up only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from mpitrain.core.config import TrainConfig, UsageError, can_take_joiners
from mpitrain.core.layout import Layout
from mpitrain.launch import faults, mpiimpl, samehost


@dataclass(frozen=True)
class Node:
    """This rank's host as MPI sees it: node-local rank, ranks here, ranks here that compute."""

    rank: int
    size: int
    busy: int  # ranks on this node other than the parameter servers (which mostly sleep)
    cores: int
    world_ranks: tuple[int, ...] = ()  # the COMM_WORLD ranks on this node (busy is recounted for --num-ps)
    # The world's ranks on this host (this rank's samehost key) that another launch started (a --join or a
    # --respawn: not in this process's MPI_COMM_WORLD), which MPI reaches over its network module (UCX, TCP),
    # not shared memory: exchange/mailbox.py gives async's exchange with rank 0 a shared-memory path of its own.
    strangers_here: tuple[int, ...] = ()

    def for_layout(self, layout: Layout) -> Node:
        if not self.world_ranks:
            return self
        return replace(self, busy=sum(1 for r in self.world_ranks if not layout.is_server(r)))

    @property
    def oversubscribed(self) -> bool:
        return self.busy > self.cores


def world(cfg: TrainConfig | None = None):
    """COMM_WORLD, with MPI initialised as every mpitrain rank needs it: training runs on the main
    thread, and a worker's heartbeat thread (liveness.py) also sends, so MPI_THREAD_MULTIPLE. With
    the run's flags, the transport settings that lost ranks and joins need are made first
    (mpiimpl.prepare_transport)."""
    import sys

    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        if cfg is not None:
            mpiimpl.prepare_transport(losses=cfg.worker_timeout > 0, joins=cfg.join or can_take_joiners(cfg))

        mpi4py.rc.thread_level = "multiple"
        from mpitrain.launch.init_watch import guard_mpi_init

        # hydra's ranks have a supervisor, which ends the job when one dies in start-up (supervise.py)
        watched = cfg is not None and cfg.worker_timeout > 0 and not mpiimpl.needs_supervisor() and \
            mpiimpl.launcher_rank(os.environ) is not None
        init_returned = guard_mpi_init(cfg.worker_timeout + 30.0 if watched else 0.0)
        try:
            from mpi4py import MPI  # MPI_Init
        finally:  # returned, or raised (no MPI library): either way the watch is over
            init_returned()
    from mpi4py import MPI

    mpiimpl.ignore_death_notices()
    comm = MPI.COMM_WORLD
    if comm.Get_size() > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # the caller's own MPI init
        raise UsageError("MPI was initialised without MPI_THREAD_MULTIPLE, which the heartbeat thread needs; "
                         "import mpitrain's API before `from mpi4py import MPI`, or set "
                         "mpi4py.rc.thread_level = 'multiple' first")
    return comm


def node_info(comm) -> Node:
    """Collective over COMM_WORLD: call it on every rank before anything can fail."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    here = tuple(node.allgather(comm.Get_rank()))  # setup-time only
    info = Node(node.Get_rank(), node.Get_size(), node.Get_size(), len(os.sched_getaffinity(0)), here,
                strangers_here(comm))
    info = info.for_layout(Layout(comm.Get_size()))  # setup() recounts with --num-ps
    impl = mpiimpl.running()
    if impl is mpiimpl.OPENMPI:  # each rank maps a peer's segment when it first sends to it: all pairs, now
        node.alltoall(list(range(node.Get_size())))
        node.Barrier()
    node.Free()
    if info.rank == 0 and impl is not None:
        unlink_init_shm(impl.shm_prefix)  # every rank on this node has mapped them: the names are not needed
        sweep_init_shm(impl.shm_prefix)  # those of this user's jobs killed before that moment
        mpiimpl.sweep_sessions(impl)  # killed launchers' folders, which a later one with the same pid trips on
    return info


def strangers_here(comm) -> tuple[int, ...]:
    """Collective over `comm`: its ranks on this host (samehost's key: the kernel's boot and pid
    namespace) that are not in this process's MPI_COMM_WORLD. Every rank of one launch answers alike about
    another launch's, so rank 0 and a worker agree on whether they are strangers without a message."""
    from mpi4py import MPI

    keys = comm.allgather(int(samehost.mine()[2]))  # setup-time only
    mine = keys[comm.Get_rank()]
    ranks = list(range(comm.Get_size()))
    group, launch = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    in_world = MPI.Group.Translate_ranks(group, ranks, launch)
    group.Free()
    launch.Free()
    found = {r for r, key, w in zip(ranks, keys, in_world) if key and key == mine and w == MPI.UNDEFINED}
    injected, me = faults.stranger_ranks(), comm.Get_rank()  # MPITRAIN_INJECT_STRANGER: a test's other launch
    found |= {r for r in ranks if r != me and (r in injected) != (me in injected)}
    return tuple(sorted(found))


# A node's shared-memory segments are named after the job, and only the rank that created one
# unlinks it, in MPI_Finalize. A job with a killed rank never gets there, so the files stay in
# /dev/shm (measured: MPICH 4 MB per node per job, "mpich_shm_<hash of the kvsname>_<node>", ch4
# posix_init.c; Open MPI 16 MB per rank, "sm_segment.<host>.<uid>.<job>.<local rank>"). With MPICH
# the next job whose PMI name hashes the same -- under Slurm "<jobid>.<step>", so any cluster that
# reuses job ids -- opens the stale segment and spins in MPI_Init forever. Once every local rank
# has mapped them (MPICH: in MPI_Init; Open MPI: at a rank's first message to each peer, so
# node_info sends one between every pair first) the names can go; the memory lives until the last
# rank unmaps it, however that rank ends.


def mapped_paths(maps: str) -> set[str]:
    """The files a process maps, from its /proc/PID/maps (empty when it cannot be read)."""
    try:
        with open(maps) as f:
            fields = [line.split(maxsplit=5) for line in f]  # address perms offset dev inode [path]
    except OSError:
        return set()
    return {f[5].strip() for f in fields if len(f) == 6}


def unlink_init_shm(prefix: str, maps: str = "/proc/self/maps", shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the init segments this process maps; returns what it removed."""
    # (not Linux: nothing mapped; a name already unlinked shows as "NAME (deleted)")
    return _unlink([path for path in sorted(mapped_paths(maps)) if os.path.dirname(path) == shm_dir
                    and os.path.basename(path).startswith(prefix) and " " not in os.path.basename(path)])


def _unlink(paths: list[str]) -> list[str]:
    """Unlink each of `paths` that can be; returns those unlinked."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


# A job killed before every rank of a node is past MPI_Init (a rank lost at start-up, issue 82) never
# gets to unlink_init_shm: its segments stay, 4 MB each under MPICH. Beside 200 of them (a day of start-up
# kills) a one-process run's MPI_Init failed once in MPICH's shared-memory bootstrap (clean-clone CI,
# 2026-12-07; a name that hashed the same is the likely cause, not proven). Nothing in such a name says
# whose it was, so a segment goes when no process maps it and it is older than any MPI_Init takes
# between creating it and mapping it.
INIT_SHM_AGE_S = 120.0


def sweep_init_shm(prefix: str, shm_dir: str = "/dev/shm", proc: str = "/proc",
                   min_age_s: float = INIT_SHM_AGE_S) -> list[str]:
    """Unlink this user's init segments that no process maps and that are `min_age_s` old; returns them."""
    import time

    now, stale = time.time(), []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    for path in (os.path.join(shm_dir, name) for name in names if name.startswith(prefix)):  # (stat theirs only)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and now - st.st_mtime >= min_age_s:
            stale.append(path)
    if not stale:  # the usual case: /proc is not read
        return []
    # (another user's process is not readable: its segments are not this user's to remove either)
    mapped = set().union(*(mapped_paths(os.path.join(proc, p, "maps")) for p in os.listdir(proc) if p.isdigit()))
    return _unlink([path for path in stale if path not in mapped])

