"""--ps-transport shm: async with the parameters in memory shared by the host's ranks, each worker
applying its own gradients under the store's lock (exchange/shm.py, modes/async_shm.py)."""

import json
import math
import os

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, child_env, keep_going, mpi_impl, mpitrain_cmd, only_on, run_detached, train

from test_ledger import EPOCH_SAMPLES  # noqa: E402

from mpitrain.exchange import shm
from mpitrain.exchange.shm_push import SharedUpdate
from mpitrain.core.exitcodes import ExitCode

pytestmark = pytest.mark.timeout(300)


def _segments() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX)}


def _none_left(before: set[str]) -> bool:
    """No segment left by the job run since `before` was taken. One an earlier killed job left may
    be gone: the job's rank 0 sweeps those (a failed test's leftover failed the next test here)."""
    return not _segments() - before


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("flags", [[], ["--optimizer", "momentum", "--ema-decay", "0.99"], ["--optimizer", "adam"]],
                         ids=["sgd", "momentum-ema", "adam"])
def test_it_learns_with_each_optimizer_and_rank_0_sees_every_step(tmp_path, flags):
    """Every step the workers applied reaches rank 0's counts once, and its evaluations fall on
    exactly the steps asked for (rank 0 holds the workers there)."""
    before = _segments()
    s = train(4, tmp_path, "--ps-transport", "shm", "--eval-every", "100", *flags)
    assert s["test_accuracy"] >= 0.93, s["_stdout"]
    assert s["global_step"] == sum(s["worker_steps"]) == s["staleness"]["gradients"]
    assert [e["global_step"] for e in s["eval_history"]] == list(range(100, s["global_step"] + 1, 100))
    assert s["staleness"]["p50"] <= 2  # no overlap and no round trip: about a step per other worker
    assert "shared memory" in s["_stdout"] and "no overlap (--ps-transport shm" in s["_stdout"] and _none_left(before)


@only_on("mpich", NUMBERS_ONLY)
def test_with_num_ps_each_shard_is_applied_under_its_own_lock_and_it_learns(tmp_path):
    """--num-ps 2: the workers apply both shards themselves, shard by shard; the second server only
    maps the store. Rank 0 counts shard 0's steps, once each, and evaluates on exactly the steps asked."""
    before = _segments()
    s = train(5, tmp_path, "--ps-transport", "shm", "--num-ps", "2", "--optimizer", "adam", "--ema-decay", "0.99",
              "--eval-every", "100")
    assert s["test_accuracy"] >= 0.93 and s["num_ps"] == 2, s["_stdout"]
    assert "rank 1 parameter-server shard 1/2 (its 3,755 params are in the host's shared store; this rank holds " \
           "nothing and waits for the end)" in s["_stdout"]  # not "(3,755 params)", as if it served them (issue 77)
    assert s["global_step"] == sum(s["worker_steps"]) == s["staleness"]["gradients"]
    assert [e["global_step"] for e in s["eval_history"]] == list(range(100, s["global_step"] + 1, 100))
    assert _none_left(before)


@only_on("mpich", NUMBERS_ONLY)
def test_local_steps_push_outer_steps_into_the_store_and_rank_0_counts_their_inner_steps(tmp_path):
    """--local-steps 8 on the store, its two shards each under its own lock: each push is one outer step
    (delayed-nesterov, its state in the store and in the checkpoint), rank 0 counts its 8 inner steps
    and evaluates at the push that crossed each multiple of 100, as on the message path; no byte goes
    through MPI."""
    before, ck = _segments(), tmp_path / "ck"
    s = train(5, tmp_path, "--ps-transport", "shm", "--num-ps", "2", "--local-steps", "8", "--eval-every", "100",
              "--checkpoint-dir", str(ck))
    assert s["global_step"] == sum(s["worker_steps"]) == 600, s["_stdout"]  # --epochs: the samples of H = 1
    # 75 blocks of 8 batches, each worker taking the next as it applies (the deal in the store): all of them, once
    assert sum(s["gradients_pushed"]) == s["staleness"]["gradients"] == 75 and min(s["gradients_pushed"]) > 0
    assert [e["samples"] for e in s["epochs"]] == [EPOCH_SAMPLES[3]] * (600 // 12)  # 12 batches an epoch
    evals = [e["global_step"] for e in s["eval_history"]]
    assert len(evals) == 6 and all(0 <= step - 100 * k < 8 for k, step in enumerate(evals, 1)), evals
    with np.load(sorted(ck.glob("ckpt-*.npz"))[-1]) as saved:
        assert int(saved["opt_t"]) == 75 and np.any(saved["opt_outer_v"] != 0)  # the momentum moved
    assert s["bytes_per_sample"] == 0 and s["test_accuracy"] >= 0.93, s["_stdout"]
    assert "local steps: each worker takes 8 steps" in s["_stdout"] and _none_left(before)


@only_on("mpich", NUMBERS_ONLY)
def test_checkpoints_fall_on_their_steps_and_a_run_resumes_from_them(tmp_path):
    ck = tmp_path / "ck"
    first = train(3, tmp_path, "--ps-transport", "shm", "--steps", "300", "--checkpoint-every-steps", "100",
                  "--checkpoint-dir", str(ck))
    assert first["global_step"] == 300
    assert sorted(p.name for p in ck.glob("ckpt-*.npz")) == [f"ckpt-{s:09d}.npz" for s in (100, 200, 300)]
    more = train(3, tmp_path, "--ps-transport", "shm", "--steps", "500", "--checkpoint-dir", str(ck))
    assert "resuming from" in more["_stdout"] and more["global_step"] == 500
    assert sum(more["worker_steps"]) == 500  # the positions went on from the checkpoint's
    assert more["test_accuracy"] >= 0.9


@pytest.mark.parametrize("point,servers,step", [("locked", 1, 5), ("applying", 1, 5), ("sharded", 2, 5),
                                               ("opening", 1, 0)])
def test_a_worker_killed_in_the_store_leaves_a_job_that_finishes_its_budget(tmp_path, point, servers, step):
    """SIGKILLed holding the lock (the kernel releases it), half-way through its step (applied,
    the version not advanced: a partial step), with --num-ps 2 half-way through shard 1 (shard 0
    applied, the rest not: the shards' counts one apart), or before it had the store's name (rank 0
    waited for it in a barrier and ended the job, exit 5, --respawn or not: seen in a local run of the
    suite, rank 0's set-up slowed by --log-dir's import of PyTorch): the others finish the budget,
    nothing is NaN, the worker is reported lost (exit 8), and no segment is left. It dies at its 5th push, in a
    budget of 2,400: at its 40th of 600 it could be too late (a soak's `applying` case exited 0 once; the others'
    600 steps take 0.1 s, and one worker made 28 of them on a busy machine: the test below)."""
    before = _segments()
    summary = tmp_path / "s.json"
    proc, _ = run_detached(mpitrain_cmd(3 + servers, "--no-progress", "--ps-transport", "shm", "--steps", "2400",
                                        "--num-ps", str(servers), "--worker-timeout", "2", "--summary-json", str(summary),
                                        launcher_flags=keep_going()),
                           env={**child_env(), "MPITRAIN_INJECT_KILL": f"{servers + 1}:{step}:{point}"}, timeout=120)
    assert proc.returncode == ExitCode.WORKER_LOST, proc.stdout + proc.stderr  # what mpirun makes of exit 8
    s = json.loads(summary.read_text())
    assert s["global_step"] == 2400 and [w["rank"] for w in s["lost_workers"]] == [servers + 1]
    assert (s["lost_workers"][0]["global_step"] == 0) == (point == "opening"), s["lost_workers"]
    assert math.isfinite(s["test_loss"]) and s["test_accuracy"] >= 0.9
    assert "Traceback" not in proc.stderr and not proc.leftovers and _none_left(before)


@only_on("mpich", "the store's ledger, the same under either MPI; a worker killed in the store runs under both")
@pytest.mark.parametrize("point,servers,twice", [("applying", 1, 1), ("stepped", 1, 0), ("sharded", 2, 1),
                                                ("stepped", 2, 0)])
def test_a_worker_killed_in_its_apply_leaves_its_block_trained_once_or_counted_twice(tmp_path, point, servers,
                                                                                     twice):
    """Issue 81, the store's window of one apply: a worker applies its gradient, counts the step, then marks its
    block of the deal applied. Killed before the mark, its block was dealt again and trained twice, and nothing
    counted it. Now rank 0 reads where the push got to (Store.settle): killed after the step's count
    (MPITRAIN_INJECT_KILL=R:STEP:stepped), the block is marked applied and trained once; killed inside the apply
    or before the count (applying), it is dealt again and counted (`batches_repeated` of the lost worker, the
    epochs' `repeated`). With --num-ps 2 its block is marked once both shards hold the gradient: killed between
    the shards (sharded), it is dealt again and counted; killed after the last one (stepped), trained once.
    Read from the workers' side (MPITRAIN_TRACE_BATCHES: each block a worker applied, at shard 0)."""
    import collections

    summary, trace = tmp_path / "s.json", tmp_path / "trace"
    trace.mkdir()
    # 8,000 steps (about 1 s; 600 took 0.1 s): the loss is noticed (0.3-0.4 s after the kill, seen) before the end
    proc, _ = run_detached(mpitrain_cmd(3 + servers, "--no-progress", "--ps-transport", "shm", "--steps", "8000",
                                        "--num-ps", str(servers), "--worker-timeout", "2", "--summary-json",
                                        str(summary), launcher_flags=keep_going()),
                           env={**child_env(), "MPITRAIN_INJECT_KILL": f"{servers + 1}:40:{point}",
                                "MPITRAIN_TRACE_BATCHES": str(trace)}, timeout=120)
    assert proc.returncode == ExitCode.WORKER_LOST, proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    assert s["global_step"] == 8000 and [w["rank"] for w in s["lost_workers"]] == [servers + 1], s["lost_workers"]
    assert s["lost_workers"][0].get("batches_repeated", 0) == twice, s["lost_workers"]
    applied = collections.Counter()
    for f in trace.glob("applied-*.txt"):
        for line in f.read_text().splitlines():
            first, n, _ = map(int, line.split())
            applied.update(range(first, first + n))
    per_epoch = EPOCH_SAMPLES[3] // 100
    complete = [e for e in s["epochs"] if e["complete"]]
    assert len(complete) >= 8000 // per_epoch - 2, s["epochs"][-3:]
    # At the stop a worker may hold a block it has not pushed yet (one at most: a slower worker's, dealt well
    # before the last; seen 40 batches before the end in a soak): missed, and a resume deals it again. A batch
    # trained twice whose step was counted (--num-ps 2: shard 0's) takes a step of --steps, one more such batch.
    out_at_stop = 0
    for e in complete:
        wrong = {g: applied[g] for g in range(e["epoch"] * per_epoch, (e["epoch"] + 1) * per_epoch) if applied[g] != 1}
        missing = [g for g, n in wrong.items() if n == 0]
        assert sum(n - 1 for n in wrong.values() if n) * 100 == e["repeated"], (e, wrong)
        assert e["missed"] == len(missing) * 100 and e["samples"] == (per_epoch - len(missing)) * 100, (e, wrong)
        out_at_stop += len(missing)
    assert out_at_stop <= 2 + twice, out_at_stop  # the two workers left, and the budget's shift
    assert sum(n - 1 for n in applied.values() if n) == twice == sum(e["repeated"] for e in s["epochs"]) // 100


def test_a_ledger_change_cut_short_by_a_death_is_undone_by_the_next_lock_holder(tmp_path):
    """The store's ledger (Store.leases) changes in several words under shard 0's lock; a worker SIGKILLed
    between two of them (the kernel frees its lock) leaves the record open, and the next holder puts the words
    back: no dealt number lost between the next fresh one and a worker's queue (chaos shm-2ps once ended a
    global step short), none dealt twice. A change carried through is never undone."""
    from mpitrain.core.ledger import Leases
    from mpitrain.duties.checkpoint import TrainState

    store = shm.Store(str(tmp_path / "store"), 10, 3, (), False, False, create=True, redeal=1)
    try:
        store.fill(TrainState(np.zeros(10, np.float32)), 3, 100, deal=Leases(7, [(50, 1)], 3, 1, 1, None))
        leases = store.leases(1, None)

        def ledger():
            return leases.fresh, leases.unapplied(), [list(q) for q in leases.out]

        store.ledger_begin(2)  # worker 2 lost: its block to deal again
        leases.lose(2)
        store.ledger_end()
        start = ledger()
        assert start == (9, [(8, 1), (50, 1), (7, 1)], [[(50, 1)], [(7, 1)], []])
        for cut in ("marked applied", "taken from the queue, not yet held", "a fresh number taken, not yet held"):
            store.ledger_begin(0)
            leases.applied(0, (50, 1))
            if cut != "marked applied":
                leases.redeal.popleft()
            if cut.startswith("a fresh"):
                leases.fresh += 1
            assert ledger() != start, cut
            assert store.ledger_undo() and ledger() == start, cut  # (the next holder's ledger_begin does this)
        store.ledger_begin(0)
        leases.applied(0, (50, 1))
        assert leases.grant(0) == (8, 1)
        store.ledger_end()
        assert not store.ledger_undo() and ledger() == (9, [(8, 1), (7, 1)], [[(8, 1)], [(7, 1)], []])
    finally:
        store.close()


def test_a_snapshot_taken_while_a_push_is_between_its_shards_says_what_of_its_block_is_in(tmp_path):
    """--num-ps on the store: rank 0's checkpoint (Store.snapshot, under every lock) may fall while a worker is
    between its shards. Its block, not yet marked, is out in the ledger: with some shards holding its gradient
    (`applying` negative) a resume deals it again, and the snapshot returns it to be counted (`partial`); with
    every shard holding it (positive) the state has it applied and a resume does not deal it again. Before,
    both were dealt again uncounted."""
    from mpitrain.core.ledger import Leases
    from mpitrain.duties.checkpoint import TrainState

    store = shm.Store(str(tmp_path / "store"), 10, 3, (), False, False, create=True, shards=2, redeal=1)
    try:
        store.fill(TrainState(np.zeros(10, np.float32)), 3, 100, deal=Leases(7, [], 3, 1, 1, None))
        leases = store.leases(1, None)
        held = [list(q) for q in leases.out]
        first = held[1][0][0]
        state, in_part = store.snapshot([0, 0, 0], leases, 3)
        assert (first, 1) in state.redeal and in_part == []  # nothing applied yet: out, as any lent block
        store.applying[1] = -(first + 1)  # shard 0 applied, shard 1 not yet
        state, in_part = store.snapshot([0, 0, 0], leases, 3)
        assert (first, 1) in state.redeal and in_part == [(first, 1)]
        store.applying[1] = first + 1  # both shards applied, the mark not yet written
        state, in_part = store.snapshot([0, 0, 0], leases, 3)
        assert (first, 1) not in state.redeal and in_part == []
        assert sorted(state.redeal) == sorted(b for w, q in enumerate(held) for b in q if w != 1)
        assert [list(q) for q in leases.out] == held  # the live ledger is not changed
    finally:
        store.close()


OFF_HOST = {**child_env(), "MPITRAIN_INJECT_OFFHOST": "2"}  # rank 2 takes another host's path (faults.py)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("flags", [[], ["--delay-compensation", "--max-staleness", "3", "--compress", "fp16"],
                                   ["--local-steps", "4"]], ids=["plain", "dc-staleness-fp16", "local-steps"])
def test_a_worker_on_another_host_sends_its_gradients_into_the_store(tmp_path, flags):
    """A worker that cannot map the store (on another host: tests/test_multihost.py runs a real one)
    keeps the message path, and rank 0 applies its gradients into the store under the same lock:
    every step once in rank 0's counts, evaluations on their steps, only its bytes through MPI; with
    delay compensation (against the reply rank 0 sent it), --max-staleness and fp16 messages too."""
    s = train(4, tmp_path, "--ps-transport", "shm", "--eval-every", "100", *flags, env=OFF_HOST)
    assert s["test_accuracy"] >= 0.93, s["_stdout"]
    assert s["global_step"] == sum(s["worker_steps"]) == 600  # --local-steps: a push's inner steps, counted once
    h = 4 if "--local-steps" in flags else 1
    assert s["staleness"]["gradients"] == sum(s["gradients_pushed"]) == 600 // h
    evals = [e["global_step"] for e in s["eval_history"]]
    assert len(evals) == 6 and all(0 <= step - 100 * k < h for k, step in enumerate(evals, 1)), evals
    sent = [b[0] for b in s["worker_bytes"]]
    assert sent[1] > 0 and sent[0] == sent[2] == 0, sent
    assert "worker rank(s) 2 run on another host" in s["_stdout"] + s["_stderr"]
    if "--max-staleness" in flags:
        assert s["staleness"]["max"] <= 3


def test_a_worker_on_another_host_killed_leaves_a_job_that_finishes_its_budget(tmp_path):
    """The remote worker SIGKILLed mid-run: rank 0 drops its requests and goes on with the store's workers.
    It dies at its 5th step, not later: on a busy machine under Open MPI it made 28 of 600 steps (CI),
    the store's workers applying their own while it waits for rank 0's reply."""
    summary = tmp_path / "s.json"
    proc, _ = run_detached(mpitrain_cmd(4, "--no-progress", "--ps-transport", "shm", "--steps", "600",
                                        "--worker-timeout", "2", "--summary-json", str(summary),
                                        launcher_flags=keep_going()),
                           env={**OFF_HOST, "MPITRAIN_INJECT_KILL": "2:5"}, timeout=120)
    assert proc.returncode == ExitCode.WORKER_LOST, proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    assert s["global_step"] == 600 and [w["rank"] for w in s["lost_workers"]] == [2]
    assert math.isfinite(s["test_loss"]) and s["test_accuracy"] >= 0.9
    assert "Traceback" not in proc.stderr and not proc.leftovers


def test_a_segment_is_swept_only_when_its_creator_is_gone(tmp_path):
    """A job killed before every rank mapped its store leaves the name; the next store on the host
    removes it, and never a live job's (nor another user's, nor a file that is not a store)."""
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    names = [shm.segment_name(dead, "a1"), shm.segment_name(os.getpid(), "b2"),
             f"{shm.PREFIX}.{os.getuid() + 1}.{dead}.c3", "mpich_shm_123"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert shm.sweep(str(tmp_path)) == [names[0]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


@only_on("mpich", NUMBERS_ONLY)
def test_max_staleness_holds_and_delay_compensation_learns_on_the_store(tmp_path):
    held = train(4, tmp_path, "--ps-transport", "shm", "--max-staleness", "2", "--straggler", "3:x5")
    assert held["staleness"]["max"] <= 2 and held["global_step"] == sum(held["worker_steps"])
    dc = train(4, tmp_path, "--ps-transport", "shm", "--delay-compensation", "--optimizer", "momentum")
    assert dc["test_accuracy"] >= 0.93, dc["_stdout"]


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_a_shared_apply_is_the_servers_update_with_the_workers_own_copy_as_the_sent_parameters(tmp_path, optimizer):
    """Two workers' SharedUpdates taking turns over one store equal one optim.ServerUpdate on private
    arrays: the optimizer's state and count, the moving average and delay compensation's mean square are
    the store's, and DC's 'parameters sent' are the worker's pulled copy. Momentum: the store's apply
    is the one-pass BLAS step (optim.axpy) into the segment's shard views, the reference NumPy's."""
    from mpitrain.cli import parse_args
    from mpitrain.core.optim import REGISTRY, ServerUpdate
    from mpitrain.duties.checkpoint import TrainState

    cfg, _ = parse_args(["--optimizer", optimizer, "--ema-decay", "0.9", "--delay-compensation", "2"])
    rng = np.random.default_rng(0)
    start = TrainState(rng.standard_normal(6).astype(np.float32), global_step=5, opt_t=5)
    parts = [slice(0, 4), slice(4, 6)]  # --num-ps 2: each worker applies both shards, each with its own counts
    names = REGISTRY[optimizer].state
    store = shm.Store(str(tmp_path / "seg"), 6, 2, names, ema=True, dc=True, create=True, shards=2)
    store.fill(start, 2, hold_at=100)
    workers = [[SharedUpdate(cfg, store, np, k, p) for k, p in enumerate(parts)] for _ in range(2)]
    assert workers[0][0].update.opt._step is (REGISTRY[optimizer].blas_step or REGISTRY[optimizer].step)
    private = start.params.copy()
    ref = ServerUpdate(cfg, private, np, 5, 5, {}, workers=1, version=5)
    for k in range(4):
        then = store.params.copy() - np.float32(0.01 * k)  # the copy a worker computed on, a little behind
        g = rng.standard_normal(6).astype(np.float32)
        ref.dc.sent = [{5 + k: then}]
        ref.apply(g, 0.01, 1, 0, 5 + k)
        for shard, p in zip(workers[k % 2], parts):
            shard.apply(g[p], 0.01, 1, 5 + k, then[p])
        np.testing.assert_allclose(store.params, private, rtol=1e-6)
    np.testing.assert_allclose(store.ema, ref.ema.avg, rtol=1e-6)
    for name in names:
        np.testing.assert_allclose(store.opt[name], ref.opt.state[name], rtol=1e-6)
    for row in store.rows:
        assert row[shm.OPT_T] == ref.opt.t == 9 and row[shm.DC_T] == ref.dc.t == 4
    store.close()


@pytest.mark.parametrize("flags", [["--ema-decay", "0.9"], ["--outer-optimizer", "sgd", "--staleness-lr", "2"]],
                         ids=["delayed-nesterov-ema", "sgd-damped"])
def test_a_shared_outer_step_is_the_servers_outer_update(tmp_path, flags):
    """--local-steps: two workers' SharedUpdates taking turns over one store (two shards) equal one
    outer.OuterUpdate on private arrays, as the message path's server applies pushes: delayed-nesterov's
    momentum and buffer and its count of pushes are the store's, and the damped sgd step's floor (1 / the
    workers still pushing) follows the store's `active` slots when a worker stops."""
    from mpitrain.cli import parse_args
    from mpitrain.core.outer import OuterUpdate
    from mpitrain.duties.checkpoint import TrainState

    cfg, _ = parse_args(["--local-steps", "4", *flags])
    rng = np.random.default_rng(0)
    start = TrainState(rng.standard_normal(6).astype(np.float32), global_step=8, opt_t=2)
    parts = [slice(0, 4), slice(4, 6)]
    names = shm.stored_state(cfg)
    assert names == (("outer_v", "outer_buf") if "sgd" not in flags else ())
    store = shm.Store(str(tmp_path / "seg"), 6, 2, names, ema=bool(cfg.ema_decay), dc=False, create=True, shards=2)
    store.fill(start, 2, hold_at=100)
    workers = [[SharedUpdate(cfg, store, np, k, p, workers=2) for k, p in enumerate(parts)] for _ in range(2)]
    private = start.params.copy()
    ref = OuterUpdate(cfg, private, np, 8, 2, {}, workers=2)
    for k in range(6):
        if k == 4:  # worker 1 stops: the floor is the whole step from now on
            store.active[1] = 0
            ref.forget(1)
        delta, w = rng.standard_normal(6).astype(np.float32), 0 if k >= 4 else k % 2
        ref.apply(delta, 0.1, 8, w, 8 + 4 * k - 8)
        for shard, p in zip(workers[w], parts):
            shard.apply(delta[p], 0.1, 8, 8 + 4 * k - 8, None)
        np.testing.assert_allclose(store.params, private, rtol=1e-6)
    for name in names:
        np.testing.assert_allclose(store.opt[name], ref.state[name], rtol=1e-6)
    if cfg.ema_decay:
        np.testing.assert_allclose(store.ema, ref.ema.avg, rtol=1e-6)
    for row in store.rows:
        assert row[shm.OPT_T] == ref.t == 8
    store.close()


@only_on("mpich", NUMBERS_ONLY)
def test_set_up_loads_the_stores_blas_before_training_and_only_for_it():
    """The store's one-pass apply needs SciPy (~0.4 s to load): set-up loads it, before the ranks
    meet and rank 0's clock starts, where it once sat inside training and cost a 3,000-step MLP run
    a quarter of its samples/s (2026-11-29). A job on the message path does not load it at all."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); from test_cli import FakeWorld; from mpitrain import modes; "
            "from mpitrain.cli import parse_args; from mpitrain.node import Node; from mpitrain.runtime import setup; "
            "cfg, _ = parse_args(['--mode', 'async', '--ps-transport', sys.argv[1], '--dataset', 'synthetic']); "
            "setup(cfg, FakeWorld(1, 3), Node(1, 3, 2, 2), modes.of); print('scipy.linalg.blas' in sys.modules)")
    loaded = {}
    for transport in ("shm", "mpi"):
        out = subprocess.run([sys.executable, "-c", code, transport], capture_output=True, text=True, timeout=120,
                             env=child_env())
        loaded[transport] = out.stdout.strip()
        assert out.returncode == 0, out.stderr
    assert loaded == {"shm": "True", "mpi": "False"}
