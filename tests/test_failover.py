"""--on-lost-server continue (failover.py): rank 0 SIGKILLed from outside mid-run, and the job goes on
to its budget with a worker as rank 0; a successor killed during the take-over ends the others in
one line. Under both MPIs: what each reports of a dead peer differs (MPICH: silence, the heartbeat
names it; Open MPI's ULFM: an error on the next message)."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    child_env,
    communicate_or_kill,
    keep_going,
    kill_session,
    kill_while_hydra_owes_it,
    mpi_impl,
    mpirun_path,
    mpitrain_cmd,
    only_on,
    own_lines,
    read_summary,
    wait_for_checkpoint,
    wait_for_training,
)
from test_ledger import EPOCH_SAMPLES, assert_each_epoch_once, read_trace

from mpitrain.core.exitcodes import ExitCode
from mpitrain.duties import checkpoint
from mpitrain.launch import mpiimpl
from mpitrain.launch.faults import rank_pids
from mpitrain.launch.lock import NAME as LOCK
from mpitrain.membership import failover

SAME = "the take-over is sync's (tested under both MPIs); --quorum only changes the loop it leaves"
THIRD = "a third server only adds peers to watch; the take-over of a shard is tested with 2 under both MPIs"
OVERLAP = "async's take-over is tested under both MPIs; --overlap with --local-steps, compressed replies change what a "\
    "worker holds"
STORE = "the store's take-over is tested under both MPIs with rank 0 killed; a shard's adds nothing MPI does"
# Digits, 3 workers: a few seconds of training; the kill comes past the first checkpoint (step 500),
# or a second in, so it lands mid-run with most of the budget left for the successor: the take-overs
# came at global steps 538-2,017 (measured, 2026-11-29; the store's shard at 5,419, SHM_BUDGET).
BUDGET = 5000
SHM_BUDGET = 12000  # a second of --ps-transport shm is ~5,000 steps
GROW_BUDGET = 6000  # room for a take-over and then a spawn and a join: it joined at 1,759 (measured)
OMPI_FORMING_CRASH = "libmpi.so.40(ompi_comm_revoke_local+"  # in the backtrace Open MPI prints of a segfault


def kill_mid_run(cmd: list[str], np_: int, victim: int | tuple[int, ...], ck=None, env=None, timeout: float = 120):
    """Start `cmd`, SIGKILL rank `victim`'s training process from outside once training is under way
    (past the first checkpoint in `ck`, or a second in), and return (the finished job, its stdout,
    stderr, whether any process outlived it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(),
                            start_new_session=True)
    try:
        wait_for_training(proc, np_)
        first = int(wait_for_checkpoint(proc, ck).stem.split("-")[1]) if ck else None
        if ck is None:
            time.sleep(1)
        pids = rank_pids(proc.pid)
        for v in victim if isinstance(victim, tuple) else (victim,):  # in that order, one after the other
            os.kill(pids[v][0], signal.SIGKILL)
        out, err = communicate_or_kill(proc, timeout)
    finally:
        leftovers = kill_session(proc)
    proc.first_checkpoint = first
    return proc, out, err, leftovers


@pytest.mark.parametrize("mode", ["sync", pytest.param("quorum", marks=only_on("mpich", SAME)), "async", "shm",
                                  pytest.param("async-local-overlap", marks=only_on("mpich", OVERLAP)),
                                  pytest.param("async-int8-both-ways", marks=only_on("mpich", OVERLAP))])
def test_rank_0_killed_mid_run_a_worker_takes_over_and_the_job_reaches_its_budget(tmp_path, mode):
    ck, summary, trace = tmp_path / "ck", tmp_path / "summary.json", tmp_path / "trace"
    trace.mkdir()
    how = {"quorum": ("--mode", "sync", "--quorum", "2"), "shm": ("--mode", "async", "--ps-transport", "shm",
                                                                 "--optimizer", "adam"),
           "async-local-overlap": ("--mode", "async", "--local-steps", "4", "--overlap"),
           "async-int8-both-ways": ("--mode", "async", "--compress", "int8", "--compress-replies")}.get(mode,
                                                                                                   ("--mode", mode))
    cmd = mpitrain_cmd(4, *how, "--no-progress", "--steps", str(BUDGET), "--worker-timeout", "1",
                       "--on-lost-server", "continue", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "500",
                       "--summary-json", str(summary), launcher_flags=keep_going())
    proc, _, err, leftovers = kill_mid_run(cmd, 4, 0, ck, env={**child_env(), "MPITRAIN_TRACE_BATCHES": str(trace)})
    first = proc.first_checkpoint  # training was under way, past this step
    assert "Traceback" not in err and not leftovers, err
    # 8, as for a lost worker; under hydra ORed with rank 0's supervisor's 137 (supervise.killed_exit)
    assert proc.returncode == ExitCode.WORKER_LOST | (137 if mpi_impl().name == "mpich" else 0), err
    s = json.loads(summary.read_text())  # written by the successor
    assert s["global_step"] == BUDGET and s["test_accuracy"] > 0.9, err
    [fo] = s["failovers"]
    assert fo["successor"] == 1 and fo["ranks"] == 3 and fo["global_step"] >= first
    # its timings cover the whole job (the successor counts its seconds as a worker): every step since 0
    assert abs(s["steps_per_second"] * s["wall_seconds"] - BUDGET) < 1e-6 * BUDGET, s["wall_seconds"]
    # the worker steps are the whole job's too, as the worker counted them (they started over at the
    # take-over's step: sync [4203, 4203] of 5000; async more than the global steps between them)
    if mode == "sync":
        assert s["worker_steps"] == s["gradients_pushed"] == [BUDGET] * 2, s["worker_steps"]
    elif mode == "async-local-overlap":  # a push carries 4 inner steps (fewer at the data's end)
        assert sum(s["worker_steps"]) <= BUDGET, s["worker_steps"]
        assert all(-(-n // 4) <= p for n, p in zip(s["worker_steps"], s["gradients_pushed"])), s["gradients_pushed"]
    elif mode != "quorum":
        assert sum(s["worker_steps"]) <= BUDGET, s["worker_steps"]
        assert all(0 <= p - n <= 2 for n, p in zip(s["worker_steps"], s["gradients_pushed"])), s["gradients_pushed"]
    if mode in ("sync", "quorum"):  # the replicas hold the whole model: nothing is lost, and they are identical
        assert fo["updates_lost_at_most"] == 0 and set(s["worker_param_digests"]) == {s["param_digest"]}
    if mode == "sync":  # the deal's count travels with the take-over: the epoch it cut goes on, each sample once
        complete = [e["epoch"] for e in s["epochs"] if e["complete"]]
        assert len(complete) >= BUDGET * 2 // 12  # 3 batches a step, then 2 after the loss
        assert {(e["samples"], e["missed"], e["repeated"]) for e in s["epochs"][:-1]} == {(EPOCH_SAMPLES[3], 0, 0)}
        trained = read_trace(trace)
        assert_each_epoch_once({e: trained[e] for e in complete}, len(complete), EPOCH_SAMPLES[3])
    elif mode == "shm":  # the store outlives rank 0: every update applied, and Adam's state, go on
        assert fo["updates_lost_at_most"] == 0, fo
        assert fo["state_kept"] == ["opt_m", "opt_v"] and "no update lost; kept: m, v" in err, err
    else:  # at most what the 3 workers had in flight (one each; two with --overlap; of 4 inner steps with H 4)
        assert 0 <= fo["updates_lost_at_most"] <= 6 * (4 if mode == "async-local-overlap" else 1), fo
        if mode.startswith("async"):
            assert_async_deal_went_on(trace, s, fo)
    took = [ln for ln in err.splitlines() if "took over as rank 0" in ln]
    assert len(took) == 1 and f"at global step {fo['global_step']}" in took[0], err
    newest = checkpoint.list_checkpoints(ck)[-1]  # the successor saves into the same folder, under its lock
    assert checkpoint.load(newest).global_step == BUDGET and not (ck / LOCK).exists()



def assert_async_deal_went_on(trace, s: dict, fo: dict) -> None:
    """Issue 81: rank 0 kept async's deal, and the take-over puts it together from what the survivors were lent
    and told (failover.lent_ledger). Read from rank 0's side (MPITRAIN_TRACE_BATCHES: each block it applied, with
    the global step it made), the lost rank 0's up to the step the successor went on from, then the successor's:
    every batch of every complete epoch applied, none missed, and those applied twice are exactly the count the
    take-over's record and the summary's epochs give (before: a worker slower by one block left a batch below that
    step never applied; a worker lost with rank 0, or just before it, left its blocks missed, and none was counted)."""
    files = sorted(trace.glob("applied-*.txt"), key=lambda f: int(f.read_text().split()[2]))  # the lost rank 0's first
    assert len(files) == 2, files
    applied = collections.Counter()
    for i, f in enumerate(files):
        for line in f.read_text().splitlines():
            first, n, step = map(int, line.split())
            if i or step <= fo["global_step"]:  # what the lost rank 0 applied after the freshest copy was lost
                applied.update(range(first, first + n))
    per_epoch = EPOCH_SAMPLES[3] // 100  # batches of 100
    complete = [e["epoch"] for e in s["epochs"] if e["complete"]]
    assert len(complete) >= BUDGET // per_epoch - 2, s["epochs"][-3:]
    for e in complete:
        wrong = {g: applied[g] for g in range(e * per_epoch, (e + 1) * per_epoch) if applied[g] not in (1, 2)}
        assert not wrong, (e, wrong, fo)
    twice = sum(n - 1 for n in applied.values())
    assert twice == fo["batches_repeated"] == sum(e["repeated"] for e in s["epochs"]) // 100, (twice, fo)
    assert not any(e["missed"] for e in s["epochs"] if e["complete"]), s["epochs"]


@only_on("mpich", "the deal is put together the same way under both MPIs (rank 0 alone killed: both)")
def test_rank_0_killed_just_after_a_worker_the_take_over_deals_again_what_both_held(tmp_path):
    """A worker and then rank 0 SIGKILLed: the worker's blocks were in rank 0's queue to deal again (it noticed
    the loss) or with the worker (it had not), below every survivor's oldest block: missed before, and the
    summary said nothing. Dealt again now, and what the copy had applied counted (assert_async_deal_went_on)."""
    ck, summary, trace = tmp_path / "ck", tmp_path / "summary.json", tmp_path / "trace"
    trace.mkdir()
    cmd = mpitrain_cmd(4, "--mode", "async", "--no-progress", "--steps", str(BUDGET), "--worker-timeout", "1",
                       "--on-lost-server", "continue", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "500",
                       "--summary-json", str(summary), launcher_flags=keep_going())
    # killed once the first checkpoint is there (step 500 of 5000): a second in, a quiet machine had finished
    proc, _, err, leftovers = kill_mid_run(cmd, 4, (3, 0), ck, env={**child_env(), "MPITRAIN_TRACE_BATCHES": str(trace)})
    assert "Traceback" not in err and not leftovers, err
    s = read_summary(summary, err)
    [fo] = s["failovers"]
    assert s["global_step"] == BUDGET and fo["ranks"] == 2, (fo, err)
    assert_async_deal_went_on(trace, s, fo)


@pytest.mark.parametrize("mode,servers", [("async", 2), pytest.param("sync", 2, marks=only_on("mpich", SAME)),
                                          pytest.param("async", 3, marks=only_on("mpich", THIRD)),
                                          pytest.param("shm", 2, marks=only_on("mpich", STORE))])
def test_a_server_shard_killed_mid_run_is_rebuilt_and_the_job_reaches_its_budget(tmp_path, mode, servers):
    """--num-ps K: the last server SIGKILLed mid-run. Rank 0, the other servers and the workers agree
    to go on; the first worker serves the lost shard from then on, from the freshest copy of it (async:
    a worker's pulled parameters; sync: the replicas), and each server left keeps its shard's exact state."""
    summary, victim, np_ = tmp_path / "summary.json", servers - 1, servers + 3
    how = ("--mode", "async", "--ps-transport", "shm") if mode == "shm" else ("--mode", mode)
    budget = SHM_BUDGET if mode == "shm" else BUDGET
    # The kill comes after the first checkpoint, a sixth of the way: "a second in" was once the budget's end
    # with the store (the shard lost after the workers had finished: no take-over; 3 runs in 4, 2026-12-03)
    ck = tmp_path / "ck"
    cmd = mpitrain_cmd(np_, *how, "--num-ps", str(servers), "--no-progress", "--steps", str(budget),
                       "--worker-timeout", "1", "--on-lost-server", "continue", "--summary-json", str(summary),
                       "--checkpoint-dir", str(ck), "--checkpoint-every-steps", str(budget // 6),
                       launcher_flags=keep_going())
    _, _, err, leftovers = kill_mid_run(cmd, np_, victim, ck)
    assert "Traceback" not in err and not leftovers, err
    s = read_summary(summary, err)
    assert s["global_step"] == budget and s["test_accuracy"] > 0.9 and s["num_ps"] == servers, err
    [fo] = s["failovers"]
    assert fo["successor"] == 0 and fo["lost_shards"] == [victim], fo
    assert fo["servers"] == [*range(victim), servers], fo
    took = [ln for ln in err.splitlines() if f"parameter-server shard {victim}/{servers} was lost" in ln]
    assert len(took) == 1 and f"rank {servers} took it over" in took[0], err
    # pushes some servers applied and others not (issue 81): the phase's own, at most one a worker at the stop;
    # a successor that counted from its own start said 119,500 samples (each server's steps from its phase's start)
    assert sum(e["partial"] for e in s["epochs"]) <= 100 * 3, [e for e in s["epochs"] if e["partial"]]


@only_on("mpich", "MPICH tells the workers nothing of a dead worker: the take-over waits for its HERE")
def test_a_worker_killed_with_rank_0_is_left_out_and_the_others_take_over(tmp_path):
    """Rank 1 and rank 0 SIGKILLed together (async: a worker watches only the servers, so nobody has
    declared rank 1 lost): the successor (rank 2) waits its deadline for rank 1's HERE, then decides;
    rank 3 waits past its own deadline for that DECIDE (chaos found it giving up just before it
    came, and the successor's new world then timed out; 1 run of 2 failed so on the old code)."""
    summary = tmp_path / "summary.json"
    budget = 4 * BUDGET  # killed a second in, not past a checkpoint: an AMD EPYC VM ran all of BUDGET by then
    cmd = mpitrain_cmd(4, "--mode", "async", "--no-progress", "--steps", str(budget), "--worker-timeout", "1",
                       "--on-lost-server", "continue", "--summary-json", str(summary), launcher_flags=keep_going())
    _, _, err, leftovers = kill_mid_run(cmd, 4, (1, 0))
    assert "Traceback" not in err and not leftovers, err
    s = read_summary(summary, err)
    [fo] = s["failovers"]
    assert fo["successor"] == 2 and fo["ranks"] == 2 and s["global_step"] == budget, (fo, err)
    # rank 1's loss went with rank 0: the successor lists it, by the take-over's step
    assert fo["workers_left_out"] == [1] and s["lost_workers"] == [
        {"rank": 1, "global_step": fo["global_step"], "reason": failover.LEFT_OUT, "worker_steps": None}], s


def test_a_successor_killed_during_the_take_over_ends_the_others_in_one_line(tmp_path):
    """Rank 1 SIGKILLs itself once it has told the others it takes over (MPITRAIN_INJECT_KILL
    takeover): they wait for it in the new world's collectives, and each ends in one line within the
    forming limit (or at once, when MPI fails the collective), never a hang."""
    cmd = mpitrain_cmd(4, "--mode", "sync", "--no-progress", "--steps", "10000000", "--worker-timeout", "1",
                       "--on-lost-server", "continue", launcher_flags=keep_going())
    env = {**child_env(), "MPITRAIN_INJECT_KILL": "1:takeover", "MPITRAIN_FORM_LIMIT_S": "4"}
    proc, _, err, leftovers = kill_mid_run(cmd, 4, 0, env=env, timeout=90)
    assert "Traceback" not in err and not leftovers, err
    if OMPI_FORMING_CRASH in err:
        # Open MPI 5.0.11's ULFM, once in CI: the failure notice of the dead successor arrived while the
        # others were inside MPI_Comm_create_from_group, and its revoke of the half-built communicator
        # segfaulted in every rank left (prterun then exited 0). Open MPI's own crash, not mpitrain's
        # ending; docs/checkpoints.md's fault table says so. Anything else still fails below.
        pytest.xfail("Open MPI's ULFM crashed in ompi_comm_revoke_local during MPI_Comm_create_from_group")
    assert proc.returncode != 0 and "took over" not in err, err
    for rank in (2, 3):
        mine = [ln for ln in own_lines(err) if ln.startswith("mpitrain:") and f"rank {rank}" in ln]
        # MPICH: the new world's collective waits for the dead successor until the forming limit; Open MPI's
        # ULFM fails it at once, some of the time ("PMIx server unreachable"): either way one line
        assert len(mine) == 1 and ("agreeing on a successor to the lost rank 0" in mine[0]
                                   or "the take-over from the lost rank 0 failed" in mine[0]), err


@only_on("mpich", "the spawn itself is tested under both MPIs (test_respawn.py); what a take-over adds is not MPI's")
def test_with_respawn_the_job_grows_back_after_a_take_over(tmp_path):
    """--respawn 1: once rank 1 has taken over from the killed rank 0, the job starts a rank in place
    of the lost one (MPI_Comm_spawn, as for a lost worker) and finishes with as many workers as it
    started with."""
    ck, summary = tmp_path / "ck", tmp_path / "summary.json"
    cmd = [mpirun_path(), *mpiimpl.local_flags(mpi_impl(), spawns=True), *keep_going(), "-np", "4", sys.executable,
           "-m", "mpitrain", "--mode", "async", "--no-progress", "--steps", str(GROW_BUDGET), "--worker-timeout", "1",
           "--on-lost-server", "continue", "--respawn", "1", "--checkpoint-dir", str(ck),
           "--checkpoint-every-steps", "500", "--summary-json", str(summary)]
    _, out, err, leftovers = kill_mid_run(cmd, 4, 0, ck)
    assert "Traceback" not in err and not leftovers, err
    s = read_summary(summary, err)
    assert s["global_step"] == GROW_BUDGET and len(s["failovers"]) == 1, err
    [spawned] = s["joined_workers"]
    assert spawned["respawned"] and len(s["worker_ranks"]) == 3, s["worker_ranks"]  # 3 workers again
    assert "a worker started in place of the lost one" in out + err


@only_on("mpich", "the spawn itself is tested under both MPIs (test_respawn.py); what a take-over adds is not MPI's")
def test_after_a_take_over_the_summary_keeps_the_lost_rank_0s_record_of_its_phases(tmp_path):
    """Worker rank 3 SIGKILLed and replaced (--respawn), then rank 0: the successor's summary lists
    that lost worker and the replacement's join, which only rank 0 had seen (it shares its record with
    every rank as a phase starts: join.Carry.share_record). Dropped on 2026-12-01 after one CI hang, not
    reproduced since: 54 of 54 runs of this job with rank 0 killed 0-3 s after the worker (during the
    spawn too) ended at their budget, beside a spinner (but one hydra SIGPIPE, the rerun rule's)."""
    summary = tmp_path / "summary.json"
    cmd = [mpirun_path(), *mpiimpl.local_flags(mpi_impl(), spawns=True), *keep_going(), "-np", "4", sys.executable,
           "-m", "mpitrain", "--mode", "async", "--no-progress", "--steps", "20000", "--worker-timeout", "1",
           "--on-lost-server", "continue", "--respawn", "1", "--checkpoint-dir", str(tmp_path / "ck"),
           "--summary-json", str(summary)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        wait_for_training(proc, 4)
        time.sleep(1)  # training under way (kill_mid_run)
        os.kill(rank_pids(proc.pid)[3][0], signal.SIGKILL)
        wait_for_training(proc, 4)  # the next phase's start lines: the replacement is rank 3
        time.sleep(0.5)
        os.kill(rank_pids(proc.pid)[0][0], signal.SIGKILL)
        _, err = communicate_or_kill(proc, 120)
    finally:
        leftovers = kill_session(proc)
    assert "Traceback" not in err and not leftovers, err
    s = read_summary(summary, err)
    [fo] = s["failovers"]
    first_lost, first_join = s["lost_workers"][0], s["joined_workers"][0]
    assert first_lost["rank"] == 3 and first_lost["global_step"] < fo["global_step"], (s["lost_workers"], err)
    assert first_lost["reason"] != failover.LEFT_OUT, first_lost
    assert first_join["respawned"] and first_join["global_step"] < fo["global_step"], s["joined_workers"]
    assert s["global_step"] == 20000, err


@only_on("mpich", "hydra's proxy owes rank 0 the spawn's answer; what a take-over adds is tested under both MPIs")
def test_rank_0_killed_while_hydra_owes_it_a_spawns_answer_is_taken_over_not_a_launcher_crash(tmp_path):
    """Rank 0 waits on hydra in MPI_Comm_spawn (a replacement for a worker lost): killed then, it left the
    proxy to write the spawn's answer into the socket it had closed on rank 0's EOF; the write failed and
    the proxy and mpiexec died, every rank with them (SOAK.md: mpiexec's SIGPIPE once, rank 0 killed as it
    spawned; docs/failover.md said 141 under hydra). Made certain here: mpiexec is stopped as rank 0 loses
    worker 3, rank 0 is killed once it waits on hydra, and mpiexec goes on once rank 0's supervisor holds
    the socket (supervise._let_answers_land): the others take over and finish the budget."""
    budget, summary = 20000, tmp_path / "summary.json"
    cmd = [mpirun_path(), *mpiimpl.local_flags(mpi_impl(), spawns=True), *keep_going(), "-np", "4", sys.executable,
           "-m", "mpitrain", "--mode", "async", "--no-progress", "--steps", str(budget), "--worker-timeout", "1",
           "--on-lost-server", "continue", "--respawn", "1", "--checkpoint-dir", str(tmp_path / "ck"),
           "--summary-json", str(summary)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**child_env(), "MPITRAIN_FORM_LIMIT_S": "10"}, start_new_session=True)
    try:
        wait_for_training(proc, 4)
        time.sleep(1)
        rank_0 = rank_pids(proc.pid)[0][0]
        os.kill(rank_pids(proc.pid)[3][0], signal.SIGKILL)
        kill_while_hydra_owes_it(proc.pid, rank_0, "rank 0 spawning a replacement", 30)  # 0.3 s after the loss
        _, err = communicate_or_kill(proc, 120)
    finally:
        leftovers = kill_session(proc)
    assert "Traceback" not in err and "HYDU" not in err and not leftovers, err
    assert proc.returncode not in (-signal.SIGPIPE, 255), (proc.returncode, err)
    s = read_summary(summary, err)
    assert s["global_step"] == budget and len(s["failovers"]) == 1, err


@only_on("mpich", SAME)
def test_a_take_over_that_would_leave_fewer_workers_than_the_quorum_ends_in_one_line_each(tmp_path):
    """--quorum 3 with 3 workers: without rank 0 the new world would have 2, so every worker says why
    it cannot go on, in one line, and ends (exit 5): no take-over, no hang, no second phase refused."""
    cmd = mpitrain_cmd(4, "--mode", "sync", "--quorum", "3", "--no-progress", "--steps", "10000000", "--worker-timeout",
                       "1", "--on-lost-server", "continue", launcher_flags=keep_going())
    proc, _, err, leftovers = kill_mid_run(cmd, 4, 0, timeout=90)
    assert "Traceback" not in err and not leftovers and "took over" not in err, err
    lines = [ln for ln in err.splitlines() if "fewer than --quorum 3" in ln]
    assert sorted(ln.split()[3] for ln in lines) == ["1", "2", "3"], err  # "mpitrain: error: rank N lost ..."



@only_on("mpich", "what it looks at is the host's /proc, not MPI's; the take-over is tested under both MPIs")
@pytest.mark.parametrize("then", ["runs-on", "dies"])
def test_a_rank_0_stopped_past_the_timeout_is_not_taken_over_while_its_process_runs(tmp_path, then):
    """Rank 0 SIGSTOPped past --worker-timeout (1 s): silent, not gone. A take-over would make a second
    rank 0 beside it (the CI run of 2026-12-01: the folder's lock refused that successor as "another
    mpitrain job", and the job hung). runs-on: let go on 5 s later, it is never taken over; each worker
    ends in one line saying it still runs, and rank 0 finds its workers gone and ends too. dies: killed
    1.5 s in, inside the time the workers give a frozen rank 0 to be gone (as one frozen inside MPI ends
    itself, stuck.py): they take over and the job reaches its budget."""
    budget = 20000
    cmd = mpitrain_cmd(4, "--mode", "async", "--no-progress", "--steps", str(budget), "--worker-timeout", "1",
                       "--on-lost-server", "continue", "--checkpoint-dir", str(tmp_path / "ck"),
                       "--summary-json", str(tmp_path / "s.json"), launcher_flags=keep_going())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        wait_for_training(proc, 4)
        time.sleep(1)
        rank0 = rank_pids(proc.pid)[0][0]
        os.kill(rank0, signal.SIGSTOP)
        if then == "dies":
            time.sleep(1.5)
            os.kill(rank0, signal.SIGKILL)
        else:
            time.sleep(5)  # the workers' timeout (1 s), their wait for it to be gone, their ends
            os.kill(rank0, signal.SIGCONT)
        _, err = communicate_or_kill(proc, 90)
    finally:
        leftovers = kill_session(proc)
    assert "Traceback" not in err and not leftovers and "in use by another mpitrain job" not in err, err
    lines = [ln for ln in err.splitlines() if f"(pid {rank0}) still runs on this host" in ln]
    if then == "dies":
        assert not lines and "took over" in err, err
        assert read_summary(tmp_path / "s.json", err)["global_step"] == budget
    else:
        assert sorted(ln.split()[3] for ln in lines) == ["1", "2", "3"], err  # "mpitrain: error: rank N lost ..."
        assert "took over" not in err and proc.returncode != 0, err


def test_a_rank_0_that_ends_the_job_on_purpose_is_not_taken_over():
    """--on-lost-worker stop with --on-lost-server continue: rank 0 ends the job on a lost worker and
    says so in its last heartbeat (under ULFM, where the others outlive it). The workers end with it;
    they take over from a rank 0 that was lost, never from one that ended the job."""
    from types import SimpleNamespace

    from mpitrain.core.layout import Layout
    from mpitrain.membership import failover
    from mpitrain.membership.liveness import ENDS_THE_JOB, PeerLost

    ctx = SimpleNamespace(cfg=SimpleNamespace(on_lost_server="continue"), layout=Layout(4, 1), is_ps=False)
    lost = PeerLost({0: "no heartbeat for 3.1 s"})
    lost.state = object()  # where the worker's loop was
    assert failover.applies(ctx, lost)
    ended = PeerLost({0: ENDS_THE_JOB})
    ended.state = lost.state
    assert not failover.applies(ctx, ended)


def test_rank_0_lost_as_a_worker_reports_hands_the_take_over_what_its_pushes_carried():
    """Rank 0 lost while a worker sends its report, its training over: the take-over starts from the
    worker's final state, counting the gradients its pushes carried (--local-steps: each push carries
    its inner steps; without, one each). The report is what the worker holds then (it had no such count:
    an AttributeError in the chaos of two take-overs, 2026-12-01)."""
    from mpitrain.core.reports import RoleResult, WorkerReport
    from mpitrain.membership.liveness import PeerLost
    from mpitrain.trainer import held_at_the_end

    for counted, want in ((48, 48), (None, 12)):
        report = WorkerReport(1, 12, 0, None, None, 0.5, 0.9, "d", {}, {}, counted=counted)
        mine = RoleResult(worker=report, held=object())
        lost = PeerLost({0: "its process (pid 1) has ended"})
        held_at_the_end(lost, mine)
        assert lost.state is mine.held and lost.counts == (want, 0)
