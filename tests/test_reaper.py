"""reaper.py against stand-ins for hydra's mpiexec and Open MPI's prterun (a process named so, with
or without a proxy child, or a child with a PMIx rank): the real partitions are tests/test_multihost.py's."""

import subprocess
import sys
import threading
import time

import pytest
from conftest import only_on

from mpitrain.launch import reaper

pytestmark = only_on("mpich", "stand-ins for either launcher, no MPI here: one suite is enough")

NAMED = """
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/PID/comm says
if sys.argv[2:] == ["with-proxy"]:  # a child named as hydra's proxy, for 3 s
    subprocess.Popen([sys.executable, "-c", __import__("textwrap").dedent('''
        import ctypes, time
        ctypes.CDLL(None).prctl(15, b"hydra_pmi_proxy", 0, 0, 0)
        time.sleep(3)''')])
if sys.argv[2:] == ["with-rank"]:  # prterun's: a rank (PMIX_RANK set) for 3 s, and a daemon for good
    import os
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"], env={**os.environ, "PMIX_RANK": "1"})
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(30)
"""


def stand_in(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", NAMED, *args], stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # named, and its child started
    return proc


def test_an_mpiexec_alone_on_its_host_is_told_why_and_ended(monkeypatch):
    monkeypatch.setattr(reaper, "GRACE_S", 0.5)
    monkeypatch.setattr(reaper, "POLL_S", 0.1)
    proc = stand_in("mpiexec")
    assert reaper.watch(proc.pid)
    assert proc.wait(timeout=5) == -15  # SIGTERM
    assert "mpirun was still waiting 0.5 s after every rank on this host had ended" in proc.stderr.read()


@pytest.mark.parametrize("launcher,child", [("mpiexec", "with-proxy"), ("prterun", "with-rank")])
def test_a_launcher_with_a_rank_here_is_waited_for_and_one_that_exits_is_left_alone(monkeypatch, launcher, child):
    monkeypatch.setattr(reaper, "GRACE_S", 1.0)
    monkeypatch.setattr(reaper, "POLL_S", 0.1)
    proc = stand_in(launcher, child)
    t0 = time.monotonic()
    assert reaper.watch(proc.pid)  # only once its proxy (3 s) is gone, and 1 s more
    assert time.monotonic() - t0 >= 2.0
    proc.wait(timeout=5)
    other = stand_in("not-mpiexec")
    assert not reaper.watch(other.pid) and other.poll() is None  # not hydra's: never touched
    other.kill()
    other.wait()
    assert not reaper.watch(other.pid)  # gone


def test_the_watchers_line_never_waits_on_a_pipe_nobody_reads():
    """mpiexec's stderr a pipe whose reader stopped reading (a test's, a wrapper's), full: the line is given
    up, not waited for; the watcher would have blocked in the write and outlived everything (seen once)."""
    import os

    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 65536)
    except BlockingIOError:  # full
        pass
    os.set_blocking(w, True)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stderr=w)
    try:
        telling = threading.Thread(target=reaper._tell, args=(stand_in.pid, "mpitrain: a line\n"), daemon=True)
        telling.start()
        telling.join(5)
        assert not telling.is_alive(), "the watcher waits on a full pipe"
    finally:  # (closing the read end ends a write still waiting: EPIPE)
        stand_in.kill()
        stand_in.wait()
        os.close(r)
        os.close(w)
