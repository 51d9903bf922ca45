"""The checks of a TrainConfig that need the world size (known on every rank, identically):
runtime.setup runs them after config_checks.validate."""

from __future__ import annotations

from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.layout import Layout


def validate_for_world(cfg: TrainConfig, size: int) -> None:
    """The checks that need the world size (known on every rank, identically)."""
    K = cfg.num_ps
    if K > 1 and K >= size:
        here = "one process trains locally with no server" if size == 1 else f"{size} ranks leave no worker"
        raise UsageError(f"--num-ps {K} needs at least {K + 1} ranks ({K} servers and a worker), and {here}; "
                         f"use mpirun -np {K + 1} or more, or a smaller --num-ps")
    if size == 1:  # trains locally: no worker to slow down, hold back or leave out
        alone = "one process trains locally, with no parameter server and no other worker"
        for given, what in ((cfg.stragglers, "--straggler slows a worker down"),
                            (cfg.max_staleness is not None, "--max-staleness bounds the staleness of async workers"),
                            (cfg.staleness_lr, "--staleness-lr damps stale async gradients"),
                            (cfg.delay_compensation is not None, "--delay-compensation corrects stale async gradients"),
                            (cfg.quorum is not None,
                             f"--quorum {cfg.quorum} averages the gradients of that many workers"),
                            (cfg.local_steps > 1, f"--local-steps {cfg.local_steps} averages the workers' models"),
                            (cfg.ps_transport != "mpi",
                             f"--ps-transport {cfg.ps_transport} carries the workers' gradients to the parameters")):
            if given:
                raise UsageError(f"{what}, but {alone}; run under mpirun (e.g. mpirun -np 3 python -m mpitrain ...) "
                                 f"or drop it")
    layout = Layout(size, K)
    workers = layout.workers
    servers = "rank 0 is the parameter server" if K == 1 else f"ranks 0..{K - 1} are the parameter servers"
    for rank, _, _ in cfg.stragglers:
        if rank >= size or layout.is_server(rank):
            where = f"ranks here are 0..{size - 1}" if rank >= size else f"it is a server (--num-ps {K})"
            raise UsageError(f"--straggler names rank {rank}, but {where} ({servers}); name a worker rank "
                             f"{layout.worker_ranks[0]}..{layout.worker_ranks[-1]}")
    if cfg.quorum is not None and cfg.quorum > workers:
        raise UsageError(f"--quorum {cfg.quorum} is more than the {workers} worker(s); use 1..{workers}")
    if cfg.max_staleness is not None and size > 1 and cfg.max_staleness < workers - 1:
        raise UsageError(f"--max-staleness {cfg.max_staleness} cannot hold with {workers} workers: when all "
                         f"compute on the same parameters one of them is {workers - 1} updates stale; "
                         f"use {workers - 1} or more")
