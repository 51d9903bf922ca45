"""waiting.poll, the one way a rank waits: ready, deadline, the watch, and no busy spin."""

import time

import pytest

from mpitrain.exchange.waiting import poll
from mpitrain.membership.liveness import PeerLost


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0  # each look at the clock is a second later
        return self.t


def test_poll_returns_true_as_soon_as_ready_and_tests_no_more():
    calls = []
    assert poll(lambda: calls.append(1) or len(calls) == 3, 0.0) is True
    assert len(calls) == 3


def test_poll_gives_up_at_the_deadline_after_trying_once_more():
    calls = []
    clock = FakeClock()
    assert poll(lambda: calls.append(1), 0.0, deadline=3.5, clock=clock) is False
    assert len(calls) == 4  # tried at t=1, 2, 3 (within the deadline) and once past it


def test_poll_looks_at_the_watch_before_each_try_and_lets_peer_lost_through():
    class Watch:
        checks = 0

        def check(self):
            self.checks += 1
            if self.checks == 3:
                raise PeerLost({2: "no heartbeat for 3.0 s"})

    watch, tries = Watch(), []
    with pytest.raises(PeerLost) as e:
        poll(lambda: tries.append(1), 0.0, watch)
    assert e.value.lost == {2: "no heartbeat for 3.0 s"} and len(tries) == 2


def test_poll_sleeps_between_tries_instead_of_spinning():
    """An idle rank must leave its core to the workers (3 ranks on 2 cores). The polling thread's
    own CPU time: the process's counts every thread of pytest's process, where an earlier in-process
    test's MPI (Open MPI's progress threads) once took 54 ms of CPU during these 100 ms (CI)."""
    tries = []
    t0, cpu0 = time.perf_counter(), time.thread_time()
    poll(lambda: tries.append(1) or len(tries) == 20, 0.005)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    assert wall >= 19 * 0.005
    assert cpu < wall / 2


def test_wait_auto_yields_in_collectives_only_where_ranks_outnumber_cores():
    from mpitrain.exchange.transport import SPIN, WORKER_POLL_S, collective_poll_s

    assert collective_poll_s("auto", oversubscribed=True) == WORKER_POLL_S > 0
    assert collective_poll_s("auto", oversubscribed=False) == SPIN == 0
    assert collective_poll_s("yield", oversubscribed=False) == WORKER_POLL_S
    assert collective_poll_s("spin", oversubscribed=True) == SPIN
