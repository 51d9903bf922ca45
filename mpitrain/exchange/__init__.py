"""How a worker's gradient meets the others' and the parameters come back, and how a rank waits
for a message: the seam between a mode's loop (modes/) and what carries the numbers.

    base.py      the interfaces: Reducer (sync: sum a buffer over the workers) and PushPull (async:
                 push a gradient to the servers, pull the parameters they answer with)
    mpi.py       MPI's: the workers' nonblocking Allreduce, and Isend/Irecv to each server (the default)
    shm.py       --ps-transport shm: the node-shared store; mailbox.py: a worker of another launch
                 on rank 0's host; shards.py: --num-ps's slices of the state gathered on rank 0
    protocol.py  the wire format (tags, header, flags); waiting.py, transport.py: poll() and Poller

The server's side is two pieces that need no messages: its update rule (core.optim.ServerUpdate)
and rank 0's duties at each global step (duties.chief.ChiefDuties.advance); modes/async_.py's
AsyncServer is the message loop that calls them.
"""
