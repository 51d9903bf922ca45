"""How a worker's gradient meets the others' and the parameters come back: the seam between a
mode's loop (modes/) and what carries the numbers.

    base.py   the interfaces: Reducer (sync: sum a buffer over the workers) and PushPull (async:
              push a gradient to the servers, pull the parameters they answer with)
    mpi.py    MPI's: the workers' nonblocking Allreduce, and Isend/Irecv to each server (the default)

The server's side is two pieces that need no messages: its update rule (optim.ServerUpdate) and
rank 0's duties at each global step (chief.ChiefDuties.advance); modes/async_.py's AsyncServer
is the message loop that calls them.
"""
