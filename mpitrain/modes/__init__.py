"""The modes, one object each (base.Mode), and the one place that reads --mode.

    async_.py     async: rank 0 (and each server of --num-ps) serves pushes and pulls; async_worker.py: workers push
    async_shm.py  async over the node-shared store (--ps-transport shm): workers apply, rank 0 follows
    sync.py       sync: the workers Allreduce their gradients; rank 0 follows the coordinator's (worker 0's) word
    quorum.py     sync --quorum Q: a coordinator averages the first Q gradients of each step
    single.py     one process: the sync loop with one worker and no server

and what they share: base.py (Mode and the roles), gradients.py (the one gradient step),
shm_remote.py (the store's workers on other hosts), quorum_parts.py, report.py.
"""

from __future__ import annotations

from mpitrain.modes.async_ import ASYNC
from mpitrain.modes.async_shm import SHM_ASYNC
from mpitrain.modes.base import Mode
from mpitrain.modes.quorum import QUORUM
from mpitrain.modes.single import SINGLE
from mpitrain.modes.sync import SYNC

BY_FLAG = {"async": ASYNC, "sync": SYNC}  # --mode
BY_TRANSPORT = {"shm": SHM_ASYNC}  # --ps-transport other than mpi: async over another path (config_checks: async only)


def of(cfg, layout) -> Mode:
    """The mode a run with these flags trains in: one process trains alone (SINGLE) whatever --mode says; sync
    with --quorum Q below the number of workers goes on without the slowest."""
    if layout.single:
        return SINGLE
    if cfg.mode == "sync" and cfg.quorum is not None and cfg.quorum < layout.workers:
        return QUORUM
    if cfg.mode == "async" and cfg.ps_transport in BY_TRANSPORT:
        return BY_TRANSPORT[cfg.ps_transport]
    return BY_FLAG[cfg.mode]
