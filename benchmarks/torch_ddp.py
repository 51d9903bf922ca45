"""PyTorch reference: the same MLP, batch, optimizer and data as mpitrain, on the CPU or one GPU.

    python benchmarks/torch_ddp.py --world 2 --steps 2000     # DistributedDataParallel over gloo
    python benchmarks/torch_ddp.py --world 1 --steps 2000     # one plain process
    python benchmarks/torch_ddp.py --device cuda --hidden 4096,4096 --batch-size 4096  # one GPU

Prints one JSON line: {"samples_per_second": ..., "world": ...}. Needs `pip install torch==2.13.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, args, out_q) -> None:
    import torch
    import torch.distributed as dist

    from support import epoch_batches, make_synthetic  # beside this script

    torch.set_num_threads(1)  # as mpitrain: one BLAS thread per process
    ds = make_synthetic(args.samples, args.features, 10, args.seed)
    sizes = [ds.n_features, *([int(h) for h in args.hidden.split(",")] if args.model == "mlp" else []), 10]
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    dev = torch.device(args.device)
    model = torch.nn.Sequential(*layers).to(dev)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    # the whole train set on the device once, as mpitrain's workers keep it
    x_all, y_all = torch.from_numpy(ds.x_train).to(dev), torch.from_numpy(ds.y_train).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    batches = []
    epoch = 0
    while len(batches) < args.steps + args.warmup:
        batches.extend(epoch_batches(ds.n_train, world, rank, args.batch_size, epoch, args.seed))
        epoch += 1
    t0 = None
    for step, idx in enumerate(batches[: args.steps + args.warmup]):
        if step == args.warmup:
            if world > 1:
                dist.barrier()
            sync()
            t0 = time.perf_counter()
        idx_t = torch.from_numpy(np.asarray(idx)).to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x_all[idx_t]), y_all[idx_t])
        loss.backward()
        opt.step()
    sync()
    elapsed = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        out_q.put(args.steps * args.batch_size * world / elapsed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--model", default="mlp")
    p.add_argument("--hidden", default="100")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--samples", type=int, default=12000)
    p.add_argument("--features", type=int, default=784)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    if args.device == "cuda" and args.world != 1:
        p.error("--device cuda measures one GPU: --world 1")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    rate = q.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    print(json.dumps({"samples_per_second": rate, "world": args.world}))


if __name__ == "__main__":
    main()
