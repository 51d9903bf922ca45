"""The data ledger (issue 81; mpitrain/core/ledger.py): every sample of an epoch once, in sync, async (over
messages and the shm store) and --quorum (applied or left out), across a lost worker, a resume on another
worker count and the deal's last, partial step; and the summary's account of it.

The MPI tests read what the workers trained from their own side (MPITRAIN_TRACE_BATCHES: the samples of every
batch taken, by phase and step), not the ledger's arithmetic: a step a regroup gave up is redone by the later
phase, and what each epoch applied must hold every sample of its whole batches once."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (child_env, communicate_or_kill, keep_going, mpitrain_cmd, only_on, run_detached, run_mpitrain,
                      wait_for_training)

from mpitrain.core import ledger
from mpitrain.core.config import UsageError
from mpitrain.core.data import epoch_batches
from mpitrain.core.exitcodes import ExitCode
from mpitrain.core.ledger import Deal, SyncDeal
from mpitrain.duties import checkpoint

DIGITS_TRAIN = 1438  # the embedded digits' training split
EPOCH_SAMPLES = {3: 1200}  # digits, batch 100, in a deal cut for 3 workers: its whole batches


def test_the_deal_cut_for_the_jobs_workers_is_each_workers_old_shard():
    """With the workers it was cut for, a sync step takes batch k of every shard: the per-worker
    shards of before (and of async), so an uninterrupted run trains on the same batches as ever."""
    deal = Deal(1000, 10, 3, seed=5)
    sd = SyncDeal(deal, step0=0, dealt0=0, workers=3, index=0, end=None)
    for w in range(3):
        own = epoch_batches(1000, 3, w, 10, 1, seed=5)  # epoch 1, shard w
        for k in range(deal.batches_per_shard):
            g = SyncDeal(deal, 0, 0, 3, w, None).number(deal.batches_per_shard + k)
            np.testing.assert_array_equal(deal.rows(g), own[k])
    assert sd.dealt_at(deal.batches_per_shard) == deal.per_epoch


@pytest.mark.parametrize("seed", range(20))
def test_regroups_and_joins_at_random_steps_deal_every_batch_once(seed):
    """A job whose worker count changes at random steps, each change giving up the step in flight
    (the workers redo it from the state they agree on): every batch number up to the end is applied
    once, the last step holds only what is left, and the account says every epoch is whole."""
    rng = random.Random(seed)
    deal = Deal(997, 7, rng.randint(1, 5), seed)
    end = rng.randint(2, 6) * deal.per_epoch
    applied = collections.Counter()
    step, dealt, workers = 0, 0, deal.shards
    while dealt < end:
        phase = [SyncDeal(deal, step, dealt, workers, i, end) for i in range(workers)]
        last = phase[0].last_step()
        whole = phase[0].last_step(whole=True)  # --quorum's end: every step before it deals each worker a batch
        assert last - 1 <= whole <= last
        assert whole == step or phase[-1].number(whole - 1) is not None  # the last worker too had a batch
        assert whole == last or phase[-1].number(whole) is None  # ...and has none in the short step after
        stop = min(last, step + rng.randint(1, 40))
        for s in range(step, stop):
            taken = [g for g in (p.number(s) for p in phase) if g is not None]
            assert len(taken) == phase[0].weight(s) > 0
            if s == stop - 1 and stop < last and rng.random() < 0.5:
                break  # given up at the regroup: not applied, dealt again
            applied.update(taken)
            step, dealt = s + 1, phase[0].dealt_at(s + 1)
        workers = max(1, workers + rng.choice([-1, 1]))
    assert sorted(applied) == list(range(end)) and set(applied.values()) == {1}
    account = ledger.epochs(deal, dealt)
    assert [e["samples"] for e in account] == [deal.per_epoch * deal.batch] * (end // deal.per_epoch)
    rows = np.concatenate([deal.rows(g) for g in range(deal.per_epoch)])  # epoch 0: distinct samples
    assert len(set(rows.tolist())) == len(rows) == deal.per_epoch * deal.batch


@pytest.mark.parametrize("seed", range(20))
def test_async_leases_apply_every_batch_once_across_losses_phase_ends_and_resumes(seed):
    """Rank 0's leases (core/ledger.Leases) over a random run: workers push their blocks in any order
    across workers, some are lost with blocks out, phases end (a join, a stop: every block out is dealt
    again by the next phase's Leases, built from the state as a resume builds it), --local-steps spans
    differ between phases. Every number up to the end is applied exactly once, and the account says
    every epoch is whole; a run cut off with blocks out counts them missed."""
    rng = random.Random(seed)
    deal = Deal(997, 7, rng.randint(1, 5), seed)
    end = rng.randint(2, 5) * deal.per_epoch
    applied = collections.Counter()
    fresh, redeal = 0, []
    while True:
        workers, span = rng.randint(1, 5), rng.choice([1, 1, 3])
        leases = ledger.Leases(fresh, redeal, workers, rng.choice([1, 2]), span, end)
        live = set(range(workers))
        for _ in range(rng.randint(1, 300)):
            holding = [w for w in live if leases.holds(w)]
            if not holding:
                break
            w = rng.choice(holding)
            if rng.random() < 0.02 and len(live) > 1:  # lost, its blocks out
                leases.lose(w)
                live.discard(w)
                continue
            block = leases.out[w][0]
            assert leases.applied(w, block) and not leases.applied(w, (block[0] + 99, 1))
            applied.update(range(block[0], block[0] + block[1]))
            leases.grant(w)
        fresh, redeal = leases.fresh, leases.unapplied()  # a phase's end, or a checkpoint resumed
        if not redeal and fresh == end:
            break
        missed = sum(e["missed"] for e in ledger.epochs(deal, fresh, redeal)) // deal.batch
        assert missed == sum(n for _, n in redeal)  # what is out is counted until a later phase applies it
    assert sorted(applied) == list(range(end)) and set(applied.values()) == {1}
    whole = [deal.per_epoch * deal.batch] * (end // deal.per_epoch)
    assert [e["samples"] for e in ledger.epochs(deal, fresh, redeal)] == whole


@pytest.mark.parametrize("seed", range(100))  # (survivors holding nothing below what rank 0 had applied: 1 in 8)
def test_a_take_over_deals_again_every_batch_its_copy_lacks_and_counts_those_it_had(seed):
    """Rank 0 (its Leases) is lost at a random moment of a random async run, perhaps between applying a push
    and answering it, perhaps with workers lost before it (their blocks in its queue to deal again) and with
    it (their blocks gone with them), perhaps at the deal's end (a survivor may hold nothing, and all of them
    less than rank 0 had lent and applied). From what the survivors hold, were answered and were told (the mark of
    each answer), put_together deals again every number the freshest copy lacks (none missed) and counts
    exactly those it deals again that the copy had applied; by epoch, the same total."""
    rng = random.Random(seed)
    per_epoch, workers, span = rng.choice([5, 12, 100]), rng.randint(2, 6), rng.choice([1, 1, 3])
    fresh0 = rng.randint(0, 50)
    redeal0 = [(b, 1) for b in sorted(rng.sample(range(fresh0), min(fresh0, rng.randint(0, 3))))]
    end = rng.choice([None, fresh0 + rng.randint(5, 60)])  # an end: workers may be left holding nothing
    leases = ledger.Leases(fresh0, redeal0, workers, rng.choice([1, 2]), span, end)
    version, applied_at = 0, {g: -1 for g in range(fresh0) if all(g != b for b, _ in redeal0)}  # number -> version
    lent = [collections.deque(leases.out[w]) for w in range(workers)]
    frontier = [max((a + n for a, n in lent[w]), default=0) for w in range(workers)]
    pushed, answered = [None] * workers, [[] for _ in range(workers)]
    copy = [(0, leases.mark())] * workers  # (version, mark) of the parameters each holds
    live, arrived = set(range(workers)), []
    for _ in range(rng.randint(0, 400)):
        ready = [w for w in live if lent[w] and pushed[w] is None]
        if arrived and (not ready or rng.random() < 0.5):  # rank 0 applies a push that came, and answers it
            w = arrived.pop(rng.randrange(len(arrived)))
            assert leases.applied(w, pushed[w])
            version += 1
            applied_at.update({g: version for g in range(pushed[w][0], sum(pushed[w]))})
            block = leases.grant(w)
            if block is not None:
                lent[w].append(block)
                frontier[w] = max(frontier[w], sum(block))
            answered[w].append(pushed[w])
            pushed[w], copy[w] = None, (version, leases.mark())
            assert copy[w][1] == ledger.mark(leases.fresh, leases.unapplied())  # kept as it goes, as computed
        elif ready and rng.random() < 0.97:
            w = rng.choice(ready)
            pushed[w] = lent[w].popleft()
            arrived.append(w)
        elif len(live) > 2:  # a worker lost before rank 0: its push never applied, its blocks dealt again
            w = rng.choice(sorted(live))
            live.discard(w)
            arrived = [v for v in arrived if v != w]
            leases.lose(w)
    for w in list(arrived):  # rank 0 applied these and died before it answered
        if rng.random() < 0.5:
            version += 1
            applied_at.update({g: version for g in range(pushed[w][0], sum(pushed[w]))})
    survivors = [w for w in sorted(live) if rng.random() < 0.7] or [min(live)]  # the others died with rank 0
    top, (low, applied) = max(copy[w] for w in survivors)
    in_copy = {g for g, v in applied_at.items() if v <= top}
    dealt = max(max(frontier[w] for w in survivors), low)  # as lent_ledger does
    held = [b for w in survivors for b in ([pushed[w]] if pushed[w] else []) + list(lent[w])]
    in_flight = [pushed[w] for w in survivors if pushed[w]]
    redeal, twice, by_epoch = ledger.put_together(dealt, low, applied, [b for w in survivors for b in answered[w]],
                                                  held, in_flight, per_epoch)
    again = {g for a, n in redeal for g in range(a, a + n)}
    assert not {g for g in range(dealt) if g not in in_copy} - again, "missed"
    assert all(g < dealt and not any(a <= g < a + n for w in survivors for a, n in answered[w]) for g in again)
    dealt_twice = (again | set(range(dealt, max([dealt, *applied_at]) + 1))) & in_copy
    assert twice == len(dealt_twice) and sum(by_epoch.values()) == twice, (twice, sorted(dealt_twice))


def test_a_take_over_that_loses_rank_0s_queue_deals_it_again():
    """The case that was missed: rank 0 held a lost worker's block (3) to deal again, and the survivors' oldest
    block was above it; the mark of their last answers (low 3) makes it dealt again."""
    redeal, twice, by_epoch = ledger.put_together(10, 3, 8, [(4, 1), (5, 1), (6, 1)], [(7, 1), (8, 1)], [(7, 1)], 5)
    assert redeal == [(3, 1), (7, 3)] and twice == 2 and by_epoch == {0: 1, 1: 1}  # 7 pushed, and 3 or 9
    assert ledger.put_together(10, 3, 5, [(4, 1), (5, 1), (6, 1)], [], [], 5)[1] is None  # the two disagree


def test_the_account_counts_blocks_out_at_the_end_as_missed():
    deal = Deal(1000, 10, 2, 0)  # 100 batches per epoch
    account = ledger.epochs(deal, 230, [(98, 2), (229, 1)])
    assert [(e["samples"], e["missed"]) for e in account] == [(980, 20), (1000, 0), (290, 10)]
    assert ledger.epochs(deal, 200) == [
        {"epoch": e, "complete": True, "samples": 1000, "missed": 0, "repeated": 0, "dropped": 0,
         "partial": 0, "left": 0}
        for e in (0, 1)]
    assert [e["complete"] for e in ledger.epochs(deal, 250)] == [True, True, False]


def test_a_checkpoint_keeps_the_deal_and_one_without_it_still_loads(tmp_path):
    state = checkpoint.TrainState(np.zeros(4, np.float32), 30, 30, positions=[30, 30], dealt=75, deal_shards=3,
                                  redeal=[(70, 2), (12, 1)], repeated={1: 2}, partial={0: 1, 5: 1},
                                  left_out={3: 4})
    path = checkpoint.save(tmp_path, state, {}, keep=2)
    back = checkpoint.load(path)
    assert (back.dealt, back.deal_shards, back.redeal) == (75, 3, [(70, 2), (12, 1)])
    assert (back.repeated, back.partial, back.left_out) == ({1: 2}, {0: 1, 5: 1}, {3: 4})
    state.partial = {0: 80}  # more than were dealt
    with pytest.raises(UsageError, match="more batches applied in part than were dealt"):
        checkpoint.load(checkpoint.save(tmp_path / "bad-partial", state, {}, keep=2))
    state.partial = {}
    state.redeal = [(74, 2)]  # past the deal: a checkpoint no run wrote
    with pytest.raises(UsageError, match="batches to deal again"):
        checkpoint.load(checkpoint.save(tmp_path / "bad", state, {}, keep=2))
    state.redeal = []
    state.dealt = None  # as checkpoints written before the ledger
    back = checkpoint.load(checkpoint.save(tmp_path / "old", state, {}, keep=2))
    assert back.dealt is None and back.deal_shards == 0


def read_trace(directory: Path) -> dict[int, list[int]]:
    """The samples each epoch trained, from every worker's trace: for each global step, the batches of
    the latest phase that took it (a regroup's later phase redoes the steps the earlier one gave up).
    A phase is named by its first step and, on each rank, its start time (a rank may start two at one step)."""
    by_step: dict[int, dict[str, tuple]] = collections.defaultdict(dict)  # step -> rank -> its latest (phase, ...)
    for f in directory.glob("rank-*.txt"):
        for line in f.read_text().splitlines():
            phase, step, epoch, *rows = line.split()
            key = (int(phase.split(":")[0]), float(phase.split(":")[1]))
            mine = by_step[int(step)]
            if f.name not in mine or mine[f.name][0] < key:
                mine[f.name] = (key, int(epoch), [int(r) for r in rows])
    epochs: dict[int, list[int]] = collections.defaultdict(list)
    for ranks in by_step.values():
        latest = max(key[0] for key, _, _ in ranks.values())
        for key, epoch, rows in ranks.values():
            if key[0] == latest:
                epochs[epoch] += rows
    return epochs


def assert_each_epoch_once(epochs: dict[int, list[int]], count: int, per_epoch: int) -> None:
    assert sorted(epochs) == list(range(count))
    for e, rows in epochs.items():
        assert len(rows) == per_epoch, (e, len(rows))
        assert len(set(rows)) == len(rows), f"epoch {e}: {len(rows) - len(set(rows))} samples twice"
        assert set(rows) <= set(range(DIGITS_TRAIN))


def test_a_sync_run_resumed_mid_epoch_on_other_worker_counts_finishes_that_epoch(tmp_path):
    """Stopped mid-epoch three times over (--steps 9 with 3 workers, to 13 with 2, then --epochs 5 with
    3; an epoch is 12 batches): each resume goes on where the deal was, each sample of every epoch once,
    the last step's lone batch on one worker; the summary's account agrees."""
    trace, ck = tmp_path / "trace", tmp_path / "ck"
    trace.mkdir()
    env = {**child_env(), "MPITRAIN_TRACE_BATCHES": str(trace)}
    summary = tmp_path / "s.json"
    for np_, budget in ((4, ("--steps", "9")), (3, ("--steps", "13")), (4, ("--epochs", "5"))):
        run = run_mpitrain(np_, "--mode", "sync", *budget, "--no-progress", "--checkpoint-dir", str(ck),
                           "--summary-json", str(summary), env=env)
        assert run.returncode == 0, run.stderr
    s = json.loads(summary.read_text())
    # 60 batches: 27 dealt in 9 steps, 8 in 4 more, and the other 25 over 3 workers in 9 (the last holds one)
    assert s["global_step"] == 22
    assert [e["samples"] for e in s["epochs"]] == [EPOCH_SAMPLES[3]] * 5
    assert {(e["missed"], e["repeated"]) for e in s["epochs"]} == {(0, 0)}
    assert_each_epoch_once(read_trace(trace), 5, EPOCH_SAMPLES[3])


def test_a_quorum_run_takes_the_jobs_deal_and_counts_what_its_updates_left_out(tmp_path):
    """--quorum 2 of 3 deals as plain sync (each step's three batches of the job's deal, one per worker) and
    every update takes two of them: each epoch's account is 800 samples applied and 400 dropped, none missed,
    across a resume mid-epoch (the checkpoint keeps the counts by epoch; the resumed run goes on with them).
    The workers' own trace: no sample computed twice in an epoch, by any worker, in either run."""
    trace, ck = tmp_path / "trace", tmp_path / "ck"
    trace.mkdir()
    env = {**child_env(), "MPITRAIN_TRACE_BATCHES": str(trace)}
    summary = tmp_path / "s.json"
    for budget in (("--steps", "6"), ("--epochs", "5")):
        run = run_mpitrain(4, "--mode", "sync", "--quorum", "2", *budget, "--no-progress", "--checkpoint-dir", str(ck),
                           "--summary-json", str(summary), env=env)
        assert run.returncode == 0, run.stderr
        if budget[0] == "--steps":  # 4 steps an epoch, one batch of three left out of each
            saved = checkpoint.load(checkpoint.list_checkpoints(ck)[-1])
            assert (saved.global_step, saved.dealt, saved.left_out) == (6, 18, {0: 4, 1: 2})
    s = json.loads(summary.read_text())
    assert s["global_step"] == 20 and s["resumed_from"].endswith("ckpt-000000006.npz")
    assert [(e["samples"], e["dropped"], e["missed"], e["complete"]) for e in s["epochs"]] == [(800, 400, 0, True)] * 5
    assert "epoch 4: 800 samples applied, 0 missed, 0 repeated, 400 dropped (dropped: in a worker's batch" in run.stdout
    computed: dict[int, list[int]] = collections.defaultdict(list)
    for f in trace.glob("rank-*.txt"):
        for line in f.read_text().splitlines():
            _, _, epoch, *rows = line.split()
            computed[int(epoch)] += [int(r) for r in rows]
    assert sorted(computed) == list(range(5))
    for e, rows in computed.items():  # the applied ones at least, the late ones too; each sample once
        assert 800 <= len(rows) <= 1200 and len(set(rows)) == len(rows), (e, len(rows), len(set(rows)))


def test_a_quorum_update_leaves_out_the_batches_of_the_workers_it_did_not_take():
    """SyncDeal.left_out against a count of every number: the workers outside `chosen`, over `span` updates,
    by the epoch each number falls in (an update's numbers may straddle two epochs)."""
    rng = random.Random(81)
    for _ in range(300):
        W, deal = rng.randint(1, 5), Deal(rng.randint(60, 400), rng.randint(1, 7), rng.randint(1, 4), 0)
        sd = SyncDeal(deal, rng.randint(0, 9), rng.randint(0, 200), W, 0, None)
        step, span = sd.step0 + rng.randint(0, 30), rng.randint(1, 20)
        chosen = rng.sample(range(W), rng.randint(0, W))
        want = collections.Counter((sd.dealt0 + (t - sd.step0) * W + w) // deal.per_epoch
                                   for t in range(step, step + span) for w in range(W) if w not in chosen)
        assert sd.left_out(step, span, chosen) == dict(want)


def test_the_ledger_in_shared_arrays_deals_as_the_one_in_memory():
    """Leases over PairQueues (the shm store's arrays, exchange/shm.Store.leases) against the in-memory Leases,
    through the same random grants, applies and losses: the same blocks, the same unapplied at every turn."""
    from mpitrain.core.ledger import Leases, PairQueue

    rng = random.Random(81)
    for _ in range(50):
        W, span, end = rng.randint(1, 4), rng.randint(1, 4), rng.choice([None, rng.randint(10, 80)])
        redeal = [(rng.randint(0, 9), rng.randint(1, span)) for _ in range(rng.randint(0, 3))]
        mine = Leases(0, redeal, W, 1, span, end)
        fresh, counts = memoryview(np.zeros(1, np.int64)), memoryview(np.zeros(2 + 2 * W, np.int64))
        pairs, held = memoryview(np.zeros(2 * (len(redeal) + 2 * W), np.int64)), memoryview(np.zeros(4 * W, np.int64))
        shared = Leases.over(fresh, PairQueue(pairs, counts[:2]),
                             [PairQueue(held[4 * w:4 * w + 4], counts[2 + 2 * w:4 + 2 * w]) for w in range(W)], span, end)
        shared.fresh = mine.fresh
        shared.redeal.extendleft(reversed(mine.redeal))
        for w in range(W):
            shared.out[w].extendleft(reversed(mine.out[w]))
        for _ in range(60):
            w = rng.randrange(W)
            if rng.random() < 0.15:
                mine.lose(w), shared.lose(w)
            elif mine.holds(w):
                block = mine.out[w][0]
                assert mine.applied(w, block) and shared.applied(w, block)
                assert mine.grant(w) == shared.grant(w)
            else:
                assert mine.grant(w) == shared.grant(w)
            assert (mine.unapplied(), mine.fresh, mine.anyone_holds()) == (shared.unapplied(), shared.fresh,
                                                                           shared.anyone_holds())


def read_leases(directory: Path) -> dict[int, list[int]]:
    """Async's trace: batch number -> the ranks that computed a gradient of it (their trace's step column)."""
    took: dict[int, list[int]] = collections.defaultdict(list)
    for f in directory.glob("rank-*.txt"):
        rank = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            took[int(line.split()[1])].append(rank)
    return took


def test_an_async_run_stopped_with_blocks_out_deals_them_again_when_resumed(tmp_path, mpi):
    """SIGTERM mid-epoch: the blocks rank 0 had lent and not applied are saved to deal again (the checkpoint
    says so), the resume on another worker count lends them first (the start broadcast carries them), and
    the job ends with every epoch whole: each batch number trained, twice only where the stop left it out.
    Fails if the stop's blocks are forgotten (the account and the trace lose them) or not saved."""
    trace, ck = tmp_path / "trace", tmp_path / "ck"
    trace.mkdir()
    env = {**child_env(), "MPITRAIN_TRACE_BATCHES": str(trace)}
    flags = ("--mode", "async", "--epochs", "200", "--no-progress", "--checkpoint-dir", str(ck),
             "--straggler", "1:0.002", "--straggler", "2:0.002")  # 2,800 batches over 2 workers: >= 2.8 s
    proc = subprocess.Popen(mpitrain_cmd(3, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    wait_for_training(proc, 3)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = communicate_or_kill(proc)
    assert proc.returncode == (mpi.stop_exit or 143), out + err
    saved = checkpoint.load(checkpoint.list_checkpoints(ck)[-1])
    assert saved.redeal and saved.dealt < 2800, (saved.dealt, saved.redeal)  # stopped mid-run, blocks out
    summary = tmp_path / "s.json"
    run = run_mpitrain(4, *flags, "--summary-json", str(summary), env=env)
    assert run.returncode == 0, run.stderr
    s = json.loads(summary.read_text())
    assert s["global_step"] == 2800 and [e["samples"] for e in s["epochs"]] == [1400] * 200
    assert {(e["complete"], e["missed"], e["repeated"]) for e in s["epochs"]} == {(True, 0, 0)}
    took = read_leases(trace)
    assert sorted(took) == list(range(2800))
    twice = {g for g, ranks in took.items() if len(ranks) > 1}  # computed before the stop, not applied (the
    assert twice <= {g for first, n in saved.redeal for g in range(first, first + n)}  # others were not begun)


def applied_numbers(files) -> collections.Counter:
    """How many times each batch number was applied, from AppliedTrace files (`FIRST COUNT STEP` lines)."""
    applied = collections.Counter()
    for f in files:
        for line in f.read_text().splitlines():
            first, n, _ = map(int, line.split())
            applied.update(range(first, first + n))
    return applied


@only_on("mpich", "rank 0's arithmetic over what each server says it applied; the kill is the same under either MPI")
def test_a_worker_killed_between_its_pushes_to_two_servers_is_counted_as_partial(tmp_path):
    """--num-ps 2 over messages: a worker SIGKILLed once its push reached server 1 and not rank 0
    (MPITRAIN_INJECT_KILL=R:STEP:parted). Server 1's slice holds that block's gradient, rank 0 deals the block
    again, and server 1 gets it twice; a push rank 0 held as it stopped the run, which server 1 applied, is
    the same. The summary counts them (`partial`, by epoch) as each server's own trace of the blocks it applied
    says: the batches applied a different number of times on the two slices. Before, nothing counted them."""
    trace, summary = tmp_path / "trace", tmp_path / "s.json"
    trace.mkdir()
    # 2,400 steps (about 1.6 s): the loss is noticed (0.3-0.4 s after the kill) before the end
    proc, _ = run_detached(mpitrain_cmd(5, "--mode", "async", "--no-progress", "--num-ps", "2", "--steps", "2400",
                                        "--worker-timeout", "2", "--summary-json", str(summary),
                                        launcher_flags=keep_going()),
                           env={**child_env(), "MPITRAIN_INJECT_KILL": "3:40:parted",
                                "MPITRAIN_TRACE_BATCHES": str(trace)}, timeout=120)
    assert proc.returncode == ExitCode.WORKER_LOST, proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    assert s["global_step"] == 2400 and [w["rank"] for w in s["lost_workers"]] == [3], s["lost_workers"]
    rank0, server1 = applied_numbers(trace.glob("applied-*.txt")), applied_numbers(trace.glob("server1-*.txt"))
    per_epoch, differ = EPOCH_SAMPLES[3] // 100, collections.Counter()
    for g in set(rank0) | set(server1):
        differ[g // per_epoch] += abs(server1[g] - rank0[g])
    killed = min(g for g in server1 if server1[g] > rank0[g])  # its block, dealt again (the others: the end's)
    assert server1[killed] == 2 and rank0[killed] == 1, (killed, server1[killed], rank0[killed])
    assert {e["epoch"]: e["partial"] // 100 for e in s["epochs"] if e["partial"]} == {
        e: n for e, n in differ.items() if n}, s["epochs"]


def test_partial_pushes_are_counted_from_the_servers_tallies_either_way_in_the_ahead_servers_epoch():
    """ledger.count_partial: rows (worker, batches applied from it, first number of its last block). Server 1 ahead
    of rank 0 by one batch of worker 0 (a push rank 0 never got): in the epoch of server 1's last block; rank 0
    ahead of server 2 by 4 batches of worker 1 (--local-steps 4, a push server 2 never got): in rank 0's block's
    epoch; the larger difference of two servers counts once; equal counts count nothing."""
    mine = np.array([(0, 30, 25), (1, 40, 96), (2, 7, 3)], np.int64)
    server1 = np.array([(0, 31, 26), (1, 40, 96), (2, 7, 3)], np.int64)
    server2 = np.array([(0, 30, 25), (1, 36, 92), (2, 7, 3)], np.int64)
    partial: dict[int, int] = {}
    ledger.count_partial(partial, mine, [server1, server2], 12)
    assert partial == {26 // 12: 1, 96 // 12: 4}
    ledger.count_partial(partial, mine, [mine], 12)  # one more server, in step: nothing
    assert partial == {2: 1, 8: 4}
    both = np.array([(0, 32, 27), (1, 40, 96), (2, 7, 3)], np.int64)  # two servers ahead, by 1 and by 2: 2
    ledger.count_partial(partial, mine, [server1, both], 12)
    assert partial == {2: 3, 8: 4}


def test_a_block_counted_twice_that_nobody_took_again_is_uncounted_in_part():
    """The store's lost worker's block is counted twice when dealt again (Store.settle); the part of it still out
    when the run ends was trained once: ledger.within finds it, count_by_epoch(-1) takes it out."""
    repeated: dict[int, int] = {}
    ledger.count_by_epoch(repeated, (10, 4), 12)  # numbers 10..13: epochs 0 and 1
    assert repeated == {0: 2, 1: 2}
    assert ledger.within((10, 4), [(0, 3), (12, 5), (40, 1)]) == [(12, 2)]
    assert ledger.within((10, 4), [(14, 2)]) == []
    for part in ledger.within((10, 4), [(12, 5)]):
        ledger.count_by_epoch(repeated, part, 12, -1)
    assert repeated == {0: 2, 1: 0}


def test_the_summary_names_the_last_complete_epoch_only_when_it_was_not_whole():
    from mpitrain.duties.metrics import epoch_lines

    whole = {"epoch": 0, "complete": True, "samples": 1200, "missed": 0, "repeated": 0, "dropped": 0,
             "partial": 0, "left": 38}
    cut = {**whole, "epoch": 1, "samples": 1000, "missed": 200}
    assert epoch_lines({"epochs": [whole, {**whole, "epoch": 1, "complete": False, "missed": 100}]}) == []
    assert epoch_lines({"epochs": None}) == []
    assert epoch_lines({"epochs": [whole, cut, {**whole, "epoch": 2, "complete": False}]}) == [
        "  epoch 1: 1,000 samples applied, 200 missed, 0 repeated, 0 dropped (a resume deals the missed again)"]
    assert epoch_lines({"epochs": [{**whole, "partial": 100}]}) == [
        "  epoch 0: 1,200 samples applied, 0 missed, 0 repeated, 0 dropped (100 applied in part: on some servers' "
        "slices only)"]


def test_the_ledger_stays_a_few_blocks_however_long_the_run():
    """60,000 samples, 16 workers, 10 epochs with a worker lost every epoch: what rank 0 keeps is at most two
    blocks per worker plus what the lost ones held (never a per-sample list), and a worker's deal caches at
    most two epochs' permutations."""
    deal = Deal(60_000, 100, 16, 0)
    end = 10 * deal.per_epoch
    leases = ledger.Leases(0, [], 16, 2, 1, end)
    live, largest, rng = list(range(16)), 0, random.Random(1)
    while any(leases.holds(w) for w in live):
        for w in list(live):
            if leases.holds(w):
                first, n = leases.out[w][0]
                assert leases.applied(w, (first, n))
                leases.grant(w)
                deal.rows(first)
                if first % deal.per_epoch == 300 and len(live) > 6:  # mid-epoch, one lost
                    victim = rng.choice(live)
                    live.remove(victim)
                    leases.lose(victim)
        largest = max(largest, len(leases.unapplied()))
        assert len(deal._perms) <= 2
    assert largest <= 2 * 16 and leases.fresh == end and not leases.unapplied()
