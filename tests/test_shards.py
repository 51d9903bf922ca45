"""--num-ps K: the parameters sharded over ranks 0..K-1 (issue 13)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import (
    NUMBERS_ONLY,
    OWN_LOGIC,
    child_env,
    communicate_or_kill,
    keep_going,
    kill_session,
    mpitrain_cmd,
    only_on,
    read_summary,
    run_mpitrain,
    train,
    wait_for_checkpoint,
    wait_for_training,
)

from mpitrain.core.layout import Layout, shard_bounds
from mpitrain.core.model import build
from mpitrain.duties import checkpoint
from mpitrain.duties.summary import digest
from mpitrain.exchange.protocol import HEADER_BYTES
from mpitrain.launch.faults import rank_pids


@pytest.mark.parametrize("n,k", [(7510, 2), (7510, 3), (10, 3), (5, 5), (101_770, 4)])
def test_shards_are_contiguous_and_balanced_by_elements(n, k):
    bounds = shard_bounds(n, k)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order, no gap
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_layout_with_two_servers():
    lay = Layout(6, 2)
    assert lay.server_ranks == (0, 1) and lay.worker_ranks == (2, 3, 4, 5) and lay.workers == 4
    assert lay.shard_index(1) == 1 and lay.worker_index(2) == 0
    assert lay.role(1) == "server" and lay.role(2) == "worker"
    assert lay.peers(2) == [0, 1]  # a worker beats to and watches every server
    assert lay.peers(0) == [1, 2, 3, 4, 5]  # the chief also watches the other servers
    assert lay.peers(1) == [0, 2, 3, 4, 5]  # ... and they watch it (not each other)
    assert lay.shard_slice(1, 7510) == slice(3755, 7510)


def test_a_message_split_into_shard_parts_receives_each_slice_in_place():
    from mpitrain.exchange.protocol import TAG_GRAD, Message

    msg = Message(10)
    parts = msg.shard_parts([slice(0, 4), slice(4, 7), slice(7, 10)])
    for part in parts:
        assert np.shares_memory(part.payload, msg.payload)
    msg.payload[:] = np.arange(10)
    assert parts[1].payload.tolist() == [4, 5, 6] and parts[1].count == 3
    parts[2].stamp(TAG_GRAD, 7)
    assert parts[2].step == 7 and msg.step == 0  # each part has its own header
    assert msg.shard_parts([slice(0, 10)]) == [msg]  # one server: the message itself
    for part in parts:
        part.free()
    # sent: the first part is the buffer's own head; the others contiguous copies, taken on refresh
    out = msg.shard_parts([slice(0, 4), slice(4, 10)], sending=True)
    assert np.shares_memory(out[0].payload, msg.payload) and not np.shares_memory(out[1].payload, msg.payload)
    msg.payload[:] = 7
    out[1].refresh()
    assert out[1].payload.tolist() == [7] * 6 and out[1].buf.nbytes == HEADER_BYTES + 6 * 4


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("k", [2, 3])
def test_async_with_several_servers_learns(tmp_path, k):
    s = train(k + 2, tmp_path, "--num-ps", str(k), "--epochs", "30")
    assert s["test_accuracy"] >= 0.93, s["test_accuracy"]
    assert s["num_ps"] == k and [p["rank"] for p in s["ps_shards"]] == list(range(k))
    n = sum(p["params"] for p in s["ps_shards"])
    assert n == 7510 and max(p["params"] for p in s["ps_shards"]) - min(p["params"] for p in s["ps_shards"]) <= 1
    # every server applied every gradient of its slice; rank 0's count is the global step
    assert all(p["global_step"] == s["global_step"] for p in s["ps_shards"])
    for p in s["ps_shards"]:  # each server carries its slice of every gradient and reply, no more
        assert p["bytes_in"] == p["bytes_out"] == s["global_step"] * (HEADER_BYTES + 4 * p["params"])
    assert s["worker_ranks"] == list(range(k, k + 2))
    lines = s["_stdout"].splitlines()
    assert f"rank 1 parameter-server shard 1/{k} ({s['ps_shards'][1]['params']:,} params)" in s["_stdout"], lines[:6]
    assert f"{k + 2} ranks: {k} PS + 2 workers" in s["_stdout"]


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("k", [2, 3])
def test_sync_with_several_servers_equals_one_server_to_the_bit(tmp_path, k):
    args = ("--mode", "sync", "--epochs", "12", "--optimizer", "momentum", "--lr", "0.1", "--ema-decay", "0.9", "--eval-every", "10")
    one = train(4, tmp_path, "--num-ps", "1", *args)
    many = train(k + 3, tmp_path, "--num-ps", str(k), *args)
    assert many["param_digest"] == one["param_digest"]
    times = ("seconds", "training_seconds")  # all but the clock
    assert [{k: v for k, v in e.items() if k not in times} for e in many["eval_history"]] == \
        [{k: v for k, v in e.items() if k not in times} for e in one["eval_history"]]
    assert many["test_accuracy"] >= 0.93


@only_on("mpich", NUMBERS_ONLY)
def test_a_sync_quorum_with_two_servers_learns(tmp_path):
    s = train(6, tmp_path, "--num-ps", "2", "--mode", "sync", "--quorum", "3", "--epochs", "40")
    assert s["quorum"] == 3 and s["workers"] == 4 and s["test_accuracy"] >= 0.93


@only_on("mpich", NUMBERS_ONLY)
def test_checkpoints_do_not_depend_on_the_number_of_servers(tmp_path):
    """Saved with K=2, resumed with K=1 and K=3: the same file, and the same end, as K=1 throughout."""
    args = ("--mode", "sync", "--optimizer", "adam", "--lr", "0.01", "--ema-decay", "0.9", "--checkpoint-every-steps", "10")
    a, b = tmp_path / "a", tmp_path / "b"
    train(5, tmp_path, "--num-ps", "2", "--checkpoint-dir", str(a), "--epochs", "5", *args)
    train(4, tmp_path, "--num-ps", "1", "--checkpoint-dir", str(b), "--epochs", "5", *args)
    for name in ("ckpt-000000010.npz", "ckpt-000000020.npz"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    resumed3 = train(6, tmp_path, "--num-ps", "3", "--checkpoint-dir", str(a), "--epochs", "9", *args)
    resumed1 = train(4, tmp_path, "--num-ps", "1", "--checkpoint-dir", str(b), "--epochs", "9", *args)
    assert resumed3["resumed_from"].endswith("ckpt-000000020.npz")
    assert resumed3["param_digest"] == resumed1["param_digest"]


@only_on("mpich", NUMBERS_ONLY)
def test_async_checkpoints_and_eval_gather_every_slice(tmp_path):
    """Async with 3 servers, Adam and a moving average: rank 0's checkpoints hold the whole state
    (every slice moved by training), and a resume with one server carries on from it."""
    ck = tmp_path / "ck"
    s = train(5, tmp_path, "--num-ps", "3", "--optimizer", "adam", "--lr", "0.01", "--ema-decay", "0.99",
              "--compress", "bf16", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "50", "--keep-checkpoints", "9",
              "--eval-every", "40",
              "--steps", "200")
    assert [e["global_step"] for e in s["eval_history"]] == [40, 80, 120, 160, 200]
    first = checkpoint.load(ck / "ckpt-000000050.npz")
    init = build("mlp", 64, (100,), 10, 0.0, np).init_params(0)  # where a fresh run starts
    for sl in (slice(0, 2504), slice(2504, 5007), slice(5007, 7510)):
        assert not np.array_equal(first.params[sl], init[sl])  # every server's slice trained
        assert np.abs(first.opt_state["m"][sl]).sum() > 0 and np.abs(first.opt_state["v"][sl]).sum() > 0
        assert np.abs(first.ema[sl] - init[sl]).sum() > 0
    final = checkpoint.load(ck / "ckpt-000000200.npz")
    assert digest(final.params) == s["param_digest"]
    resumed = train(3, tmp_path, "--checkpoint-dir", str(ck), "--optimizer", "adam", "--lr", "0.01", "--ema-decay",
                    "0.99", "--compress", "bf16", "--steps", "400")
    # (200 more steps, not 100: async Adam on bf16 wobbles, 0.88-0.96 measured 100 steps after the resume,
    # and 0.84 once in CI after 200: above 0.8 it learned on; a fresh model scores ~0.1)
    assert resumed["resumed_from"].endswith("ckpt-000000200.npz") and resumed["global_step"] == 400
    assert resumed["test_accuracy"] >= 0.8


@only_on("mpich", NUMBERS_ONLY)
def test_a_staleness_bound_holds_on_every_server(tmp_path):
    s = train(5, tmp_path, "--num-ps", "2", "--max-staleness", "2", "--epochs", "10")
    assert [p["staleness"]["max"] for p in s["ps_shards"]] == [2, 2]  # reached, never passed, on each server
    assert s["staleness"] == s["ps_shards"][0]["staleness"] and s["test_accuracy"] >= 0.9


@pytest.mark.parametrize("np_,args,needs", [
    (2, ("--num-ps", "2"), "--num-ps 2 needs at least 3 ranks"),
    (3, ("--num-ps", "3"), "--num-ps 3 needs at least 4 ranks"),
    (3, ("--num-ps", "0"), "--num-ps must be at least 1"),
    (4, ("--num-ps", "2", "--straggler", "1:0.1"), "--straggler names rank 1, but it is a server"),
])
def test_bad_num_ps_is_one_line_and_exit_2(np_, args, needs):
    proc = run_mpitrain(np_, "--no-progress", *args)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpitrain: error")]
    assert len(errors) == 1 and needs in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_lost_server_ends_the_job_naming_its_shard(tmp_path, mode):
    """SIGKILL rank 1 (shard 1 of 2) from outside while training runs: rank 0 names the shard and
    the newest checkpoint in one line, every other rank stops, nothing hangs."""
    ck = tmp_path / "ck"
    cmd = mpitrain_cmd(5, "--no-progress", "--num-ps", "2", "--mode", mode, "--steps", "10000000", "--worker-timeout",
                       "1", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "20",
                       launcher_flags=keep_going())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        wait_for_training(proc, 5)
        wait_for_checkpoint(proc, ck)  # the line below must name it
        killed_at = time.monotonic()
        os.kill(rank_pids(proc.pid)[1][0], signal.SIGKILL)
        _, err = communicate_or_kill(proc, 30)
        assert time.monotonic() - killed_at < 1 + 10, err
    finally:
        leftovers = kill_session(proc)
    assert proc.returncode != 0 and not leftovers
    lines = [ln for ln in err.splitlines() if "lost parameter-server shard 1/2 (rank 1: " in ln]
    assert len(lines) == 1 and "the newest checkpoint is" in lines[0] and str(ck) in lines[0], err
    assert "Traceback" not in err


@only_on("mpich", OWN_LOGIC)
def test_async_with_two_servers_finishes_without_a_worker_killed_from_outside(tmp_path):
    """A worker SIGKILLed at a random moment (mid-message to one server or both, often): every
    server drops it, the others finish the budget, rank 0 names it once and saves the end. About 1
    kill in 50 meets MPICH's documented stuck ending instead (a server stuck on the worker's half-
    enqueued message: stuck.py; soak, 2026-11-28); read_summary's text then carries its line, and
    the one rerun applies."""
    import random

    summary, ck = tmp_path / "s.json", tmp_path / "ck"
    cmd = mpitrain_cmd(5, "--no-progress", "--num-ps", "2", "--hidden", "2000", "--steps", "1500", "--worker-timeout",
                       "2", "--summary-json", str(summary), "--checkpoint-dir", str(ck),
                       launcher_flags=keep_going())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        wait_for_training(proc, 5)
        time.sleep(random.uniform(0.2, 1.0))
        os.kill(rank_pids(proc.pid)[3][0], signal.SIGKILL)
        _, err = communicate_or_kill(proc, 90)
    finally:
        kill_session(proc)
    s = read_summary(summary, err)
    assert [w["rank"] for w in s["lost_workers"]] == [3], err
    assert s["global_step"] == 1500 and s["worker_ranks"] == [2, 4]
    assert err.count("worker rank 3 lost at global step") == 1, err  # rank 0's line only
    assert checkpoint.load(ck / "ckpt-000001500.npz").global_step == 1500
    assert "Traceback" not in err


@only_on("mpich", OWN_LOGIC)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_non_finite_loss_stops_every_server_with_exit_4(tmp_path, mode):
    """Rank 3's 20th gradient is NaN. 20 epochs of 12 batches: sync gives each of the 3 workers 80, async lends
    them as they ask (5 epochs, 60 in all, once left rank 3 short of 20 under a loaded CI: the run ended well)."""
    env = {**child_env(), "MPITRAIN_INJECT_NAN": "3:20"}
    proc = run_mpitrain(5, "--no-progress", "--num-ps", "2", "--mode", mode, "--epochs", "20", env=env)
    assert proc.returncode == 4, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "training diverged" in ln]
    assert len(lines) == 1 and "worker rank 3's loss is not finite" in lines[0], proc.stderr


@only_on("mpich", NUMBERS_ONLY)
def test_the_timeline_has_a_track_for_every_server(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    s = train(5, tmp_path, "--num-ps", "2", "--epochs", "3", "--timeline", str(trace), "--timeline-steps", "10")
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    by_rank = {r: {e["name"] for e in spans if e["pid"] == r} for r in range(5)}
    assert {"apply", "push", "wait"} <= by_rank[1]  # the second server serves its slice
    assert all({"compute", "push", "pull"} <= by_rank[r] for r in (2, 3, 4))
    assert all("timeline" not in p for p in s["ps_shards"])  # the spans go to the trace, not the summary
