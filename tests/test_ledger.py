"""The data ledger (issue 81; mpitrain/core/ledger.py): every sample of an epoch once, in sync, across a lost
worker, a resume on another worker count and the deal's last, partial step; and the summary's account of it.

The MPI tests read what the workers trained from their own side (MPITRAIN_TRACE_BATCHES: the samples of every
batch taken, by phase and step), not the ledger's arithmetic: a step a regroup gave up is redone by the later
phase, and what each epoch applied must hold every sample of its whole batches once."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env, run_mpitrain

from mpitrain.core import ledger
from mpitrain.core.data import epoch_batches
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
    account = ledger.epochs(deal, [(-1, dealt)])
    assert [e["samples"] for e in account] == [deal.per_epoch * deal.batch] * (end // deal.per_epoch)
    rows = np.concatenate([deal.rows(g) for g in range(deal.per_epoch)])  # epoch 0: distinct samples
    assert len(set(rows.tolist())) == len(rows) == deal.per_epoch * deal.batch


def test_the_account_names_what_a_lost_async_worker_left():
    """Async: each worker's own shard; one lost for good leaves the rest of its shard in every epoch begun."""
    deal = Deal(1000, 10, 2, 0)  # 50 batches per shard
    account = ledger.epochs(deal, [(0, 120), (1, 70)], lost={1})
    assert [(e["samples"], e["missed"]) for e in account] == [(1000, 0), (700, 300), (200, 500)]
    assert ledger.epochs(deal, [(0, 100), (1, 100)]) == [
        {"epoch": e, "samples": 1000, "missed": 0, "repeated": 0, "dropped": 0, "left": 0} for e in (0, 1)]


def test_a_checkpoint_keeps_the_deal_and_one_without_it_still_loads(tmp_path):
    state = checkpoint.TrainState(np.zeros(4, np.float32), 30, 30, positions=[30, 30], dealt=75, deal_shards=3)
    path = checkpoint.save(tmp_path, state, {}, keep=2)
    back = checkpoint.load(path)
    assert (back.dealt, back.deal_shards) == (75, 3)
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
