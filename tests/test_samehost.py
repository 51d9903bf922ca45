"""samehost: a peer's process that has ended on this host is seen in /proc, and nothing else is."""

import signal
import subprocess
import time

from mpitrain.launch import samehost


def _peer(proc: subprocess.Popen) -> tuple[float, float, float]:
    state, started = samehost._stat(proc.pid)
    return float(proc.pid), float(started), samehost.mine()[2]


def test_a_live_process_is_not_ended_nor_a_stopped_one():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        peer = _peer(proc)
        assert samehost.ended(peer) is None and samehost.alive(peer)
        proc.send_signal(signal.SIGSTOP)  # frozen, not dead: the heartbeat timeout's case
        time.sleep(0.1)
        assert samehost.ended(peer) is None
        assert samehost.alive(peer)  # a take-over would make a second rank 0 beside it (failover.still_running)
        assert not samehost.alive((peer[0], peer[1], peer[2] + 1))  # another host's: never certain
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_process_is_ended_as_a_zombie_and_once_reaped():
    proc = subprocess.Popen(["sleep", "30"])
    peer = _peer(proc)
    proc.kill()
    deadline = time.monotonic() + 5
    while samehost._stat(proc.pid)[0] not in "ZX" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert samehost.ended(peer) == f"its process (pid {proc.pid}) has exited"  # not reaped yet
    assert not samehost.alive(peer)
    proc.wait()
    assert samehost.ended(peer) == f"its process (pid {proc.pid}) has ended" and not samehost.alive(peer)


def test_a_pid_that_names_another_process_now_is_ended():
    """The start time tells a reused pid from the process the heartbeats named."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        pid, started, key = _peer(proc)
        assert samehost.ended((pid, started - 1, key)) == f"its process (pid {proc.pid}) has ended"
    finally:
        proc.kill()
        proc.wait()


def test_another_host_or_pid_namespace_or_no_identity_is_never_looked_at():
    proc = subprocess.Popen(["true"])
    proc.wait()  # gone: yet not ours to judge under another key
    pid, _, key = float(proc.pid), 1.0, samehost.mine()[2]
    assert samehost.ended((pid, 1.0, key)) is not None
    assert samehost.ended((pid, 1.0, key + 1)) is None
    assert samehost.ended((0.0, 0.0, 0.0)) is None
    mine = samehost.mine()
    assert mine[0] > 0 and mine[2] > 0 and mine[2] < 2 ** samehost.KEY_BITS  # exact in a float64 beat field
