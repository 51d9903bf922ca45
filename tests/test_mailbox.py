"""Async's mailbox (exchange/mailbox.py): who gets one, and the segment's own promises. The exchange
itself, a torn push and the cleanup are tested end to end with a replacement killed mid-write
(test_respawn.py); the chaos case respawn-mailbox kills one at random moments (benchmarks/CHAOS-*)."""

import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.core.config import TrainConfig
from mpitrain.core.layout import Layout
from mpitrain.exchange import mailbox, shm
from mpitrain.exchange.protocol import TAG_GRAD, Message


def ctx_for(rank: int, strangers: tuple[int, ...], size: int = 3, **flags):
    cfg = replace(TrainConfig(), **flags)
    return SimpleNamespace(cfg=cfg, rank=rank, layout=Layout(size, cfg.num_ps),
                           node=SimpleNamespace(strangers_here=strangers))


def test_a_worker_gets_a_mailbox_only_from_rank_0_of_another_launch_on_its_host_and_both_agree():
    # rank 0 sees rank 2 as a stranger here (spawned), and rank 2 sees rank 0 (and rank 1) so
    assert mailbox.wanted(ctx_for(0, (2,)), 2) and mailbox.wanted(ctx_for(2, (0, 1)), 2)
    assert not mailbox.wanted(ctx_for(0, (2,)), 1) and not mailbox.wanted(ctx_for(1, (2,)), 1)
    assert not mailbox.wanted(ctx_for(0, ()), 2) and not mailbox.wanted(ctx_for(2, ()), 2)  # one launch, or another host
    for flags in ({"joined_link": "mpi"}, {"ps_transport": "shm"}, {"num_ps": 2}):
        size = 4 if flags.get("num_ps") else 3
        assert not mailbox.wanted(ctx_for(0, (size - 1,), size, **flags), size - 1), flags
        assert not mailbox.wanted(ctx_for(size - 1, (0,), size, **flags), size - 1), flags
    assert not mailbox.wanted(ctx_for(0, (0,), 1), 0)  # one process: no server


def test_a_mapped_segment_sees_what_its_creator_wrote_and_keeps_its_headers(tmp_path):
    """The worker maps a segment rank 0 may already have written: its Messages must not clear a header
    (Message(clear=False)); a goodbye is a header-only message over a gradient slot's header; the file is
    mode 0600 (the job's user only)."""
    path = str(tmp_path / "box")
    mine = mailbox.Segment(path, 5, np.float16, create=True)
    assert os.stat(path).st_mode & 0o777 == 0o600
    mine.params[1].payload[:] = np.arange(5)
    mine.params[1].stamp(12, step=7)
    theirs = mailbox.Segment(path, 5, np.float16, create=False)
    assert theirs.params[1].step == 7 and list(theirs.params[1].payload) == [0, 1, 2, 3, 4]
    theirs.byes[0].stamp(TAG_GRAD, 3, 9, 2048)
    mine.grads[0].check(TAG_GRAD, 2, count=0)  # rank 0 reads the goodbye through the slot it knows
    assert mine.grads[0].flags == 2048 and theirs.grads[0].payload.dtype == np.float16
    theirs.counters[mailbox.PUSHED] = 1
    assert mine.counters[mailbox.PUSHED] == 1
    mine.unlink()
    assert not os.path.exists(path)
    theirs.close()
    mine.close()
    with pytest.raises(FileExistsError):  # never over another's file: O_EXCL
        open(path, "w").close()
        mailbox.Segment(path, 5, np.float32, create=True)


def test_a_mailbox_left_by_a_killed_rank_0_is_swept_and_a_live_ones_is_not():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = os.path.join(shm.SHM_DIR, shm.segment_name(int(dead.stdout), "feed", mailbox.PREFIX))
    alive = os.path.join(shm.SHM_DIR, shm.segment_name(os.getpid(), "beef", mailbox.PREFIX))
    store = os.path.join(shm.SHM_DIR, shm.segment_name(int(dead.stdout), "cafe"))  # the shm store's: not ours
    for p in (gone, alive, store):
        open(p, "w").close()
    try:
        assert os.path.basename(gone) in mailbox.sweep()  # (and any other a killed job left)
        assert os.path.exists(alive) and os.path.exists(store) and not os.path.exists(gone)
    finally:
        for p in (gone, alive, store):
            if os.path.exists(p):
                os.unlink(p)


def test_message_over_memory_that_holds_one_keeps_it_unless_asked_to_clear():
    raw = np.zeros(Message(4).buf.nbytes, np.uint8)
    first = Message(4, lambda n: raw[:n])
    first.stamp(TAG_GRAD, step=5)
    assert Message(4, lambda n: raw[:n], clear=False).step == 5
    assert Message(4, lambda n: raw[:n]).step == 0
