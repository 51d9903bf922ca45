"""How long a receive waits for a sender that computes after its Isend, by buffer kind
(docs/notes/mpich-noncontiguous-send-progress.md).

    mpirun -np 2 python benchmarks/noncontiguous_send.py
"""

import time

import numpy as np
from mpi4py import MPI

from support import Message, Part  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)

N = 39_755  # one of two shards of the MLP 784-100-10
COMPUTE_S = 0.005  # what the sender does after its Isend, without an MPI call
REPS = 5


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    whole = np.zeros(2 * N, np.float32)
    struct_send, contig = Part(whole[N:]), Message(N)
    struct_recv = Part(np.zeros(2 * N, np.float32)[N:])
    cases = [("contiguous -> contiguous", contig, Message(N)), ("struct -> contiguous", struct_send, Message(N)),
             ("contiguous -> struct", contig, struct_recv)]
    for name, send, recv in cases:
        waits = []
        for _ in range(REPS):
            comm.Barrier()
            if rank == 0:
                req = comm.Isend(send.spec(), dest=1, tag=1)
                time.sleep(COMPUTE_S)
                req.Wait()
            else:
                t0 = time.perf_counter()
                comm.Recv(recv.spec(), source=0, tag=1)
                waits.append(time.perf_counter() - t0)
        if rank == 1:
            print(f"{name}: receive took {1e3 * sorted(waits)[REPS // 2]:.2f} ms (median of {REPS}) "
                  f"while the sender computed {1e3 * COMPUTE_S:.0f} ms", flush=True)
    struct_send.free()
    struct_recv.free()


if __name__ == "__main__":
    main()
