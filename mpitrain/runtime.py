"""The per-rank context: who I am, what I compute on, what I train, and on which data.

`setup()` does everything that can fail because of the user's input (flags, data, GPU) before
any rank talks to another about training, so that a failure is agreed on by every rank and
reported once (see cli.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mpitrain.backend import Backend, make_backend
from mpitrain.config import TrainConfig, UsageError
from mpitrain.data import Dataset, check_batch_fits, load_dataset, steps_per_epoch
from mpitrain.model import MLP

PS_RANK = 0


@dataclass
class Context:
    cfg: TrainConfig
    comm: object  # MPI.COMM_WORLD
    rank: int
    size: int
    node_rank: int
    host: str
    backend: Backend
    data: Dataset
    model: MLP
    worker_comm: object = None  # sync mode: the workers only (rank 0 is not in the hot collective)

    @property
    def local(self) -> bool:
        """One process: train with no parameter server."""
        return self.size == 1

    @property
    def workers(self) -> int:
        return 1 if self.local else self.size - 1

    @property
    def is_ps(self) -> bool:
        return self.rank == PS_RANK and not self.local

    @property
    def worker_index(self) -> int:
        """0-based index among workers (the local process is worker 0)."""
        return 0 if self.local else self.rank - 1

    @property
    def role(self) -> str:
        return "local" if self.local else ("parameter-server" if self.is_ps else "worker")

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.data.n_train, self.workers, self.cfg.batch_size)

    @property
    def global_batch(self) -> int:
        """Examples behind one global step: one worker's batch in async, all workers' in sync."""
        return self.cfg.batch_size * (self.workers if self.cfg.mode == "sync" else 1)

    def placement(self) -> str:
        """The seeds' log_device_placement, one line per rank."""
        return f"rank {self.rank} {self.role} {self.host} {self.backend.description}"


def check_launch(size: int, env=os.environ) -> None:
    """Plain `srun python -m mpitrain` without PMI starts N singletons that each train alone."""
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if ntasks and ntasks.isdigit() and int(ntasks) > 1 and size == 1:
        raise UsageError(f"Slurm started {ntasks} tasks but MPI sees a world of 1: launch with "
                         "`srun --mpi=pmi2 python -m mpitrain` (or `mpirun -np $SLURM_NTASKS ...`)")


def setup(cfg: TrainConfig, comm, node_rank: int) -> Context:
    """Raises UsageError for anything the user must fix. Performs no communication."""
    rank, size = comm.Get_rank(), comm.Get_size()
    check_launch(size)
    is_ps = rank == PS_RANK and size > 1
    backend = make_backend(cfg.device, node_rank, uses_gpu=not is_ps)
    data = load_dataset(cfg)
    workers = 1 if size == 1 else size - 1
    check_batch_fits(data.n_train, workers, cfg.batch_size)
    sizes = (data.n_features, *cfg.layer_sizes_hidden, data.n_classes)
    model = MLP(sizes, cfg.l2, backend.xp)
    return Context(cfg, comm, rank, size, node_rank, socket.gethostname(), backend, data, model)
