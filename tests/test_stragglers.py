"""Stragglers, the sync quorum, async bounded staleness (np=4: 1 parameter server + 3 workers)."""

import json

import pytest
from conftest import NUMBERS_ONLY, OWN_LOGIC, child_env, only_on, train

from mpitrain.core.config import UsageError
from mpitrain.core.config_io import parse_straggler
from mpitrain.core.optim import staleness_scaled_lr
from mpitrain.duties import observe
from mpitrain.duties.metrics import staleness_summary
from mpitrain.modes.quorum_parts import PACE_PROBE, PACE_RUN, PACE_SLACK, PACE_WINDOW, CoordinatorPace

DIGITS_NP4 = ["--epochs", "40"]


@only_on("mpich", OWN_LOGIC)
@pytest.mark.parametrize("slow", [3, 1], ids=["a-worker", "the-chief"])
def test_quorum_with_a_straggler_drops_late_gradients_and_keeps_replicas_identical(tmp_path, slow):
    """Rank 1 is the chief worker, which decides every step: slow, it must still decide on time
    (its main thread tallies while its gradient thread is slow), and be left out like any other."""
    # 5 ms a step, not a multiple: on a fast machine x5 of a tiny step hid inside a quorum round trip
    # (seen on 16 cores: nothing was dropped)
    s = train(4, tmp_path, "--mode", "sync", "--quorum", "2", "--straggler", f"{slow}:0.005", *DIGITS_NP4)
    w = slow - 1  # its worker index
    assert s["quorum"] == 2
    assert s["dropped_gradients"] > 0
    assert s["dropped_gradients"] == sum(s["dropped_gradients_per_worker"])
    assert s["dropped_gradients_per_worker"][w] > 0  # the straggler's
    # every update averaged exactly 2 gradients: the contributions add up to 2 per global step
    assert sum(s["worker_steps"]) == 2 * s["global_step"]
    assert s["worker_steps"][w] < min(c for i, c in enumerate(s["worker_steps"]) if i != w)  # it contributed least
    assert set(s["worker_param_digests"]) == {s["param_digest"]}  # replicas identical
    assert s["test_accuracy"] >= 0.90
    assert f"straggler effect: rank {slow} (0.005 s/step); quorum 2 of 3" in s["_stdout"]


def test_chief_pace_moves_its_gradients_to_the_thread_only_while_it_is_the_slow_one():
    pace = CoordinatorPace(others=2, quorum=2)
    for _ in range(PACE_RUN):
        pace.computed(1.0)
    assert pace.inline  # nobody heard from yet: nothing to compare with
    for t0, t1 in [(0.1, 0.5)] * PACE_WINDOW + [(0.1, 0.01)]:  # one fast outlier: the lower median ignores it
        pace.heard(0, t0)
        pace.heard(1, t1)
    slow, fast = PACE_SLACK * 0.5 * 1.01, 0.1  # against the 2nd fastest other worker's 0.5 s
    for _ in range(PACE_RUN):
        pace.computed(PACE_SLACK * 0.5)
    assert pace.inline  # the step needs the 2nd fastest other worker anyway: computing inline costs nothing
    for _ in range(PACE_RUN - 1):
        pace.computed(slow)
    pace.computed(fast)
    for _ in range(PACE_RUN - 1):
        pace.computed(slow)
    assert pace.inline  # slow gradients, but not PACE_RUN in a row: preempted steps, not a slow chief
    pace.computed(slow)
    assert not pace.inline  # PACE_RUN in a row: on the thread
    for _ in range(PACE_RUN - 1):
        pace.computed(fast)
    pace.computed(slow)
    for _ in range(PACE_RUN - 1):
        pace.computed(fast)
    assert not pace.inline  # the same on the way back
    pace.computed(fast)
    assert pace.inline


def test_on_its_thread_the_chief_probes_its_pace_on_the_main_thread():
    """On the thread its gradients measure slower than inline (the main thread's polling takes the GIL
    from it), so every PACE_PROBE-th is computed inline: a slow probe sends it back to the thread at once,
    a fast one keeps it inline. Without the probes a chief slow by chance for a few rounds stayed on its
    thread for good, its rounds always too late: [64, 1436] (CI)."""
    pace = CoordinatorPace(others=1, quorum=1)
    for _ in range(PACE_WINDOW):
        pace.heard(0, 1.0)
    for _ in range(PACE_RUN):
        pace.computed(3.0)
    assert not pace.inline
    for _ in range(PACE_PROBE - 1):
        pace.computed(3.0)  # slow on the thread, as it measures there
        assert not pace.inline
    pace.computed(3.0)
    assert pace.inline and pace.probing  # the next one is a probe, inline
    pace.computed(3.0)  # still slow inline: a real straggler, back on the thread at once
    assert not pace.inline and not pace.probing
    for _ in range(PACE_PROBE):
        pace.computed(3.0)
    assert pace.inline and pace.probing
    pace.computed(1.2)  # inline it keeps up: it stays there
    assert pace.inline and not pace.probing
    for _ in range(PACE_RUN - 1):
        pace.computed(3.0)
    assert pace.inline  # and leaves only as it came, after PACE_RUN slow ones in a row


@only_on("mpich", OWN_LOGIC)
@pytest.mark.parametrize("slow", [2, 1], ids=["the-other-worker", "slow-chief"])
def test_the_chief_computes_on_its_main_thread_unless_it_is_the_slow_one(tmp_path, slow):
    """Faster than the others, the chief computes its gradients on its main thread (no hand-over to
    a thread: --quorum 1 then keeps up with plain sync); slow, on its gradient thread, so that its
    main thread closes every step on the others' gradients (the timeline tells the two apart).
    The other worker is the slow one in the first case, not nobody: with 3 ranks on 2 cores, which of two
    equal workers is the slower is the scheduler's draw (CI: 81 inline, 93 on the thread)."""
    trace = tmp_path / "trace.json"
    s = train(3, tmp_path, "--mode", "sync", "--quorum", "1", "--steps", "200", "--timeline", str(trace),
              "--timeline-steps", "1000", "--straggler", f"{slow}:0.01")
    spans = [e for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "X" and e["pid"] == 1 and e["name"] == "compute"]
    inline = sum(e["tid"] == observe.THREAD_MAIN for e in spans)
    threaded = sum(e["tid"] == observe.THREAD_HELPER for e in spans)
    # every gradient it computed went into a step or was dropped (one still on the thread at the end: neither)
    extra = inline + threaded - s["worker_steps"][0] - s["dropped_gradients_per_worker"][0]
    assert 0 <= extra <= 1, (inline, threaded, s["worker_steps"], s["dropped_gradients_per_worker"])
    if slow == 1:
        # on its thread after PACE_RUN slow gradients (one more if the others were not heard from yet)
        assert threaded > 0 and inline <= PACE_RUN + 1 + threaded // PACE_PROBE and s["worker_steps"][0] < 20
    else:
        assert inline > 4 * threaded, (inline, threaded)
    assert set(s["worker_param_digests"]) == {s["param_digest"]}


@only_on("mpich", OWN_LOGIC)
def test_quorum_with_a_straggler_more_updates_behind_than_the_chief_keeps(tmp_path):
    """At 0.1 s a gradient, rank 3 falls more than UPDATES_IN_FLIGHT updates behind: the chief
    then waits for it to take the oldest, and every update still reaches it, in order."""
    s = train(4, tmp_path, "--mode", "sync", "--quorum", "2", "--straggler", "3:0.1", "--steps", "120",
              "--hidden", "32")
    assert s["global_step"] == 120 and sum(s["worker_steps"]) == 240
    assert s["dropped_gradients_per_worker"][2] > 0
    assert set(s["worker_param_digests"]) == {s["param_digest"]}


@only_on("mpich", OWN_LOGIC)
@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_quorum_with_a_compressed_wire_keeps_replicas_identical(tmp_path, compress):
    """The chief applies its update as the others receive it: rounded to the wire's 16 bits (it
    would drift from them if it kept its float32 mean)."""
    s = train(4, tmp_path, "--mode", "sync", "--quorum", "2", "--compress", compress, "--straggler", "3:0.003",
              "--steps", "150")
    assert sum(s["worker_steps"]) == 2 * s["global_step"] == 300
    assert set(s["worker_param_digests"]) == {s["param_digest"]}
    assert s["test_accuracy"] >= 0.85


def test_a_worker_never_heard_from_is_waited_for_a_few_times_then_taken_for_a_straggler():
    """owed_until, on the coordinator (worker 0) with one other worker that has not pushed yet and is
    owed a turn: its push is due as if it were as fast as the coordinator (PACE_SLACK x its compute
    time after the update went out), for UNHEARD_HOLDS holds; after that, nothing is waited for."""
    import time
    from types import SimpleNamespace

    from mpitrain.modes.quorum import QuorumCoordinator
    from mpitrain.modes.quorum_parts import OWED_MARGIN_S, UNHEARD_HOLDS

    now = time.perf_counter()
    coord = SimpleNamespace(taken=[3, 0], helper=SimpleNamespace(seconds=0.5), pace=CoordinatorPace(1, 1), chosen=[0],
                            sent_at=now, unheard_holds=[0], unheard=[])
    due = QuorumCoordinator.owed_until(coord)
    assert due == pytest.approx(now + PACE_SLACK * 0.5 + OWED_MARGIN_S) and coord.unheard == [0]
    coord.unheard_holds = [UNHEARD_HOLDS]  # it let that many holds expire: a straggler
    assert QuorumCoordinator.owed_until(coord) is None and coord.unheard == []
    coord.pace.heard(0, 0.6)  # once heard from, its own pace counts
    assert QuorumCoordinator.owed_until(coord) == pytest.approx(now + PACE_SLACK * 0.6 + OWED_MARGIN_S)
    coord.pace.heard(0, 5.0)
    coord.pace.heard(0, 5.0)  # slower than PACE_SLACK x the coordinator's: not waited for
    assert QuorumCoordinator.owed_until(coord) is None


def test_a_late_contribution_tells_the_coordinator_its_pace_and_is_not_counted():
    """A follower's contribution finished after its step closed comes as a header only (FLAG_LATE):
    the coordinator hears its time, counts nothing, and posts its receive again."""
    import time
    from collections import deque
    from types import SimpleNamespace

    from mpitrain.exchange.protocol import FLAG_LATE, TAG_QGRAD, Message
    from mpitrain.modes.quorum import QuorumCoordinator
    from mpitrain.modes.quorum_parts import OWED_MARGIN_S

    msg = Message(4)
    msg.stamp(TAG_QGRAD, 6, 3, FLAG_LATE, 0.5, 0.25)  # a round of step 6's parameters, 0.25 s
    added, posted = [], []
    act = SimpleNamespace(moved=lambda **k: None)
    coord = SimpleNamespace(inbox=[msg], others=[2], ctx=SimpleNamespace(activity=act), stopped=0, pace=CoordinatorPace(1, 1), chosen=[], Q=1, recv=[None],
                            _add=lambda *a: added.append(a), _post=lambda m, r: posted.append(r) or "posted")
    QuorumCoordinator._receive(coord, 0, 6)  # even at its own step: it carries no gradient
    assert list(coord.pace.others[0]) == [0.25] and added == [] and coord.recv == ["posted"]
    # a worker whose only pace was a slow first round is owed a turn again once its late rounds say so
    coord.taken, coord.helper, coord.sent_at = [3, 0], SimpleNamespace(seconds=0.2), time.perf_counter()
    coord.unheard_holds, coord.pace.others[0] = [0], deque([5.0])
    assert QuorumCoordinator.owed_until(coord) is None  # 25x the coordinator's: a straggler
    for _ in range(2):
        QuorumCoordinator._receive(coord, 0, 7)
    assert QuorumCoordinator.owed_until(coord) == pytest.approx(coord.sent_at + PACE_SLACK * 0.25 + OWED_MARGIN_S)


@only_on("mpich", OWN_LOGIC)
@pytest.mark.parametrize("np_,quorum,local,pause", [(3, 1, "1", ""), (4, 2, "1", ""), (3, 1, "8", ""),
                                                    (3, 1, "8", "2:2:1.0")],
                         ids=["1-of-2", "2-of-3", "1-of-2-local-steps", "1-of-2-local-steps-a-pause"])
def test_without_a_straggler_the_quorum_counts_every_worker(tmp_path, np_, quorum, local, pause):
    """TF's backup workers take gradients as they come: no worker's shard may starve. The chief's
    own gradient is ready first every step (the others first receive the update); before
    quorum.owed_until it won almost every step: --quorum 1 of 2 counted [2994, 6]. With --local-steps 8
    a worker whose rounds end just after the coordinator's never pushed one, so was never heard from
    nor waited for: [350, 0] in 2 runs of 6, until owed_until gave such a worker the benefit of the doubt.
    A worker slow for a while (`pause`: rank 2 stops for 1 s before its second round) is no straggler
    for good: while its late rounds went unreported (FLAG_LATE) it counted [1492, 8] in 2 runs of 9,
    its first pace the coordinator's last word on it; [1500, 0] once in CI without a pause."""
    env = {**child_env(), "MPITRAIN_INJECT_HANG": pause} if pause else None
    s = train(np_, tmp_path, "--mode", "sync", "--quorum", str(quorum), "--steps", "1500", "--local-steps", local,
              env=env)
    counted = s["worker_steps"]
    assert sum(counted) == quorum * 1500  # every update averaged exactly Q gradients
    # No worker starves (the failures this guards against were [2994, 6] and [350, 0]); who wins each
    # round is a race, so shares differ: [480, 1020] once under Open MPI on a busy 2-core VM (CI, 2026-11-27).
    # [344, 1156] on a 2-core VM loaded beside the suite (2026-12-03): a share, not a starving worker
    assert max(counted) <= 8 * min(counted), counted
    assert set(s["worker_param_digests"]) == {s["param_digest"]}


@only_on("mpich", OWN_LOGIC)
def test_quorum_equal_to_workers_drops_nothing(tmp_path):
    s = train(4, tmp_path, "--mode", "sync", "--quorum", "3", "--straggler", "3:x3", "--steps", "40")
    assert s["quorum"] == 3 and s["dropped_gradients"] == 0
    assert s["worker_steps"] == [40, 40, 40]
    assert s["staleness"]["max"] == 0  # sync gradients are never stale
    assert "waits for the slowest every step" in s["_stdout"]


@only_on("mpich", NUMBERS_ONLY)
def test_max_staleness_is_never_exceeded(tmp_path):
    bounded = train(4, tmp_path, "--max-staleness", "2", "--straggler", "3:0.005", *DIGITS_NP4)
    assert bounded["staleness"]["gradients"] == bounded["global_step"]
    assert bounded["staleness"]["max"] <= 2
    assert bounded["test_accuracy"] >= 0.90
    free = train(4, tmp_path, "--straggler", "3:0.005", *DIGITS_NP4)
    assert free["staleness"]["max"] > 2  # without the bound it is exceeded: the bound binds
    assert free["staleness"]["p50"] <= free["staleness"]["p99"] <= free["staleness"]["max"]


@only_on("mpich", NUMBERS_ONLY)
def test_staleness_lr_trains(tmp_path):
    plain = train(3, tmp_path, "--steps", "200")
    scaled = train(3, tmp_path, "--steps", "200", "--staleness-lr")
    assert scaled["param_digest"] != plain["param_digest"]
    assert scaled["test_accuracy"] >= 0.85


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_eval_every_records_history(tmp_path, mode):
    s = train(3, tmp_path, "--mode", mode, "--steps", "120", "--eval-every", "40")
    steps = [e["global_step"] for e in s["eval_history"]]
    assert steps == [40, 80, 120]
    seconds = [e["seconds"] for e in s["eval_history"]]
    assert seconds == sorted(seconds)
    assert s["eval_history"][-1]["test_accuracy"] > s["eval_history"][0]["test_accuracy"] - 0.05
    if mode == "sync":  # the last evaluation is of the final parameters
        assert s["eval_history"][-1]["test_accuracy"] == pytest.approx(s["test_accuracy"])


@only_on("mpich", NUMBERS_ONLY)
def test_eval_every_with_quorum(tmp_path):
    s = train(4, tmp_path, "--mode", "sync", "--quorum", "2", "--steps", "60", "--eval-every", "30")
    assert [e["global_step"] for e in s["eval_history"]] == [30, 60]


@pytest.mark.parametrize("text,expected", [("3:x5", (3, "factor", 5.0)), ("1:0.01", (1, "delay", 0.01)),
                                           ("2:X2.5", (2, "factor", 2.5))])
def test_straggler_spec(text, expected):
    assert parse_straggler(text) == expected


@pytest.mark.parametrize("text,needle", [("0:1", "parameter server"), ("1:-1", "zero or more"),
                                         ("1:x0.5", "at least 1"), ("x:1", "RANK:SECONDS"), ("3", "RANK:SECONDS")])
def test_bad_straggler_spec(text, needle):
    with pytest.raises(UsageError, match=needle):
        parse_straggler(text)


def test_staleness_summary_quantiles():
    s = staleness_summary({0: 50, 1: 40, 9: 10})
    assert (s["p50"], s["p99"], s["max"], s["gradients"]) == (0, 9, 9, 100)
    assert s["mean"] == pytest.approx(0.4 + 0.9)
    assert staleness_summary({}) == {"mean": 0.0, "p50": 0, "p99": 0, "max": 0, "gradients": 0}


def test_staleness_scaled_lr():
    assert staleness_scaled_lr(0.3, 0) == 0.3 and staleness_scaled_lr(0.3, 1) == 0.3
    assert staleness_scaled_lr(0.3, 3) == pytest.approx(0.1)


def test_staleness_rule_keeps_every_pending_gradient_within_the_bound():
    from mpitrain.core.optim import StalenessHold

    staleness_feasible = StalenessHold(2).allows
    # 3 workers, S=2, all start on step 0's parameters; A was applied at step 0 (basis 1 now).
    # Applying A again at g=1 would leave B and C, both on step 0, needing steps 2 and 3: C at 3.
    assert not staleness_feasible(1, [0, 0])
    # B (basis 0) may go: then C (0) at step 2 and A (1) at step 3 are both 2 stale
    assert staleness_feasible(1, [0, 1])
    assert staleness_feasible(0, [0, 0])  # the first update of a run
    assert not staleness_feasible(0, [0, 0, 0])  # 4 workers on the same parameters need S >= 3
    assert StalenessHold(None).allows(10**6, [0, 0, 0])  # no --max-staleness: anything goes
    # --local-steps 4: an update is 4 global steps, and S counts updates. At g=4 (A applied once), with B
    # and C on step 0: B at 4 and C at 8 are 1 and 2 updates stale; A again first would leave C at 12.
    outer = StalenessHold(2, span=4).allows
    assert outer(4, [0, 4]) and not outer(4, [0, 0])
