"""--spares N: the last N ranks mpirun starts wait as hot spares, and a lost worker's place goes to
one of them (spares.py). As users meet it: a worker SIGKILLed from outside is replaced by the spare
in the time the job takes to re-form (async under MPICH, sync under Open MPI, where the replacement
keeps the shared memory a spawned worker lacks); a job that needs no spare ends as one without;
bad flags end in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    MPI_TIMEOUT_S,
    Lines,
    child_env,
    keep_going,
    kill_session,
    mpi_impl,
    mpirun_path,
    only_on,
    read_summary,
)

from mpitrain.launch import mpiimpl
from mpitrain.membership import join
from mpitrain.launch.faults import rank_pids
from mpitrain.membership.lobby import Lobby
from mpitrain.membership.spares import Pool, Spare
from mpitrain.core.stop import StopRequest
from mpitrain.core.exitcodes import ExitCode


def spares_cmd(tmp_path, *args: str, np_: int) -> list[str]:
    """The job under this MPI's keep-going flag; nothing is spawned, so Open MPI's shared memory alone."""
    return [mpirun_path(), *mpiimpl.local_flags(mpi_impl()), *keep_going(), "-np", str(np_), sys.executable, "-m",
            "mpitrain", *args, "--no-progress", "--worker-timeout", "3", "--checkpoint-dir", str(tmp_path / "ck"),
            "--summary-json", str(tmp_path / "s.json")]


def run_and_kill(tmp_path, *args: str, np_: int, victim: int, wait_for: str = "joined as rank",
                 env=None) -> tuple[subprocess.Popen, str, float]:
    """Start the job, SIGKILL rank `victim`'s process once it trains, wait for the end. Returns the
    process, its output and the seconds from the kill to rank 0's `wait_for` line."""
    proc = subprocess.Popen(spares_cmd(tmp_path, *args, np_=np_), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**child_env(), **(env or {})}, start_new_session=True)
    lines = Lines(proc.stdout)
    try:
        last = np_ - 1 - int(args[args.index("--spares") + 1])
        assert lines.wait(f"rank {last} worker"), lines.text()  # the last worker's start line (a spare has none)
        time.sleep(1)
        os.kill(rank_pids(proc.pid)[victim][0], signal.SIGKILL)
        killed = time.monotonic()
        assert lines.wait(wait_for, 1, 60), lines.text()
        joined_s = time.monotonic() - killed
        proc.wait(MPI_TIMEOUT_S)
    finally:
        leftovers = kill_session(proc)
    assert not leftovers, lines.text()
    return proc, lines.text(), joined_s


@only_on("mpich", "the spare's join under Open MPI is the sync test below")
def test_a_killed_worker_is_replaced_by_the_spare_at_once_and_the_job_finishes_its_budget(tmp_path):
    """Async, np 5 = rank 0 + 3 workers + 1 spare: worker rank 2 SIGKILLed from outside; the spare
    (world rank 4) joins as rank 3 within seconds (no process to start: a respawn takes ~2 s here,
    benchmarks/AFTER_RESPAWN.md), the job ends its budget with 3 workers, and the summary says it was a spare."""
    budget = 12000
    proc, text, joined_s = run_and_kill(tmp_path, "--mode", "async", "--steps", str(budget), "--spares", "1",
                                        np_=5, victim=2)
    assert proc.returncode == ExitCode.WORKER_LOST, text
    assert "spare rank 4 on" in text and "takes the lost worker's place" in text and "the spare on" in text, text
    assert joined_s < 1.5, (joined_s, text)
    assert "Traceback" not in text, text
    s = read_summary(tmp_path / "s.json", text)
    assert s["global_step"] == budget and len(s["worker_steps"]) == 3, s
    assert [w["rank"] for w in s["lost_workers"]] == [2]
    assert [(j["rank"], j["spare"], j["respawned"]) for j in s["joined_workers"]] == [(3, True, False)]


@only_on("openmpi", "the spare's join under MPICH is the async test above")
def test_under_open_mpi_sync_regroups_and_takes_the_spare_in(tmp_path):
    """Sync under Open MPI (its ULFM regroup first, then the spare in): the job ends its budget with the
    workers it started with, the replacement one of mpirun's own ranks (mpirun without TCP: a spawned
    worker could not have joined)."""
    budget = 6000
    proc, text, _ = run_and_kill(tmp_path, "--mode", "sync", "--steps", str(budget), "--spares", "1", np_=5, victim=1)
    assert proc.returncode == ExitCode.WORKER_LOST, text
    assert "regrouped" in text and "the spare on" in text and "Traceback" not in text, text
    s = read_summary(tmp_path / "s.json", text)
    assert s["global_step"] == budget and len(s["worker_steps"]) == 3, s
    assert [j["spare"] for j in s["joined_workers"]] == [True]


@pytest.mark.parametrize("kills", [pytest.param(2, marks=only_on("mpich", "a second take-over adds no MPI")),
                                   pytest.param(1, marks=only_on("openmpi", "the take-over under MPICH is kills=2"))])
def test_with_on_lost_server_continue_each_successor_of_rank_0_takes_the_spares_over(tmp_path, kills):
    """--spares with --on-lost-server continue: rank 0 SIGKILLed from outside; the worker that takes over
    also takes the waiting spares over (spares.adopt, on connections the workers made at the start) and lets
    one in at once, in its own worker's place. Under MPICH, np 7 with 2 spares: the successor is killed too,
    and the next one takes the spare left. The job ends its budget with as many workers as it started with.
    Under Open MPI, once: its ULFM fails the spare's receives from the dead rank 0 instead of leaving them."""
    budget, spares_n = 16000, kills
    np_ = 4 + 1 + spares_n
    cmd = spares_cmd(tmp_path, "--mode", "async", "--steps", str(budget), "--spares", str(spares_n), "--on-lost-server",
                     "continue", "--checkpoint-every-steps", "5000", np_=np_)
    cmd[cmd.index("--worker-timeout") + 1] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)
    lines = Lines(proc.stdout)
    try:
        assert lines.wait("rank 4 worker"), lines.text()
        time.sleep(1)
        for k, victim in enumerate((0, 1)[:kills], 1):  # rank 0, then the successor (world rank 1)
            os.kill(rank_pids(proc.pid)[victim][0], signal.SIGKILL)
            assert lines.wait("took over the spares", k, 60) and lines.wait("joined as rank 4", k, 60), lines.text()
            # the phase with the spare trains (its start lines): a rank 0 killed while that world forms ends the
            # job instead (FORM_LIMIT_S; docs/elastic.md)
            assert lines.wait("rank 4 worker", k + 1, 60), lines.text()
            time.sleep(1)
        proc.wait(MPI_TIMEOUT_S)
    finally:
        leftovers = kill_session(proc)
    text = lines.text()
    assert not leftovers and "Traceback" not in text, text
    # 8; under hydra ORed with the killed rank 0's supervisor's 137 (supervise.killed_exit; README's exit codes)
    assert proc.returncode == ExitCode.WORKER_LOST | (137 if mpi_impl().name == "mpich" else 0), text
    first = 4 + 1  # world rank of the first spare
    adopted = [ln for ln in text.splitlines() if "took over the spares" in ln]
    said = [f"{spares_n - k} spare(s) waiting: rank {first + k} on" in ln for k, ln in enumerate(adopted)]
    assert said == [True] * kills, adopted
    assert f"spare rank {np_ - 1}: the job's rank 0 was lost; waiting for rank 1, which took over" in text, text
    if kills == 2:
        assert f"spare rank {np_ - 1}: the job's rank 0 was lost; waiting for rank 2, which took over" in text, text
    s = read_summary(tmp_path / "s.json", text)
    assert s["global_step"] == budget and len(s["failovers"]) == kills, s["failovers"]
    assert len(s["worker_steps"]) == 4 and not s["lost_workers"], s  # the workers it started with
    joins = s["joined_workers"]  # each successor's spare: rank 0's record goes to every rank (Carry.share_record)
    assert len(joins) == kills and all(j["spare"] for j in joins), joins
    assert all(j["global_step"] >= fo["global_step"] for j, fo in zip(joins, s["failovers"])), (joins, s["failovers"])


@only_on("mpich", "hydra's MPI_Finalize is what waited for the dead spare")
def test_a_spare_killed_while_it_waits_is_dropped_and_nobody_waits_for_it_at_the_end(tmp_path):
    """The spare is one of mpirun's ranks: once it died, MPI_Finalize would wait for it in every rank
    (measured: each said "MPI_Finalize still waiting" 5 s). Rank 0 drops it in one line, the job ends
    its budget, and every rank leaves without MPI_Finalize, as after any lost peer."""
    budget = 12000
    proc, text, _ = run_and_kill(tmp_path, "--steps", str(budget), "--spares", "1", np_=5, victim=4,
                                 wait_for="is gone (its process has ended)")
    assert proc.returncode == 0, text  # rank 0's: no worker lost (the spare's supervisor says its line and exits 0)
    assert "spare rank 4 on" in text and "0 spare(s) left" in text, text
    assert "MPI_Finalize still waiting" not in text and "Traceback" not in text, text
    s = read_summary(tmp_path / "s.json", text)
    assert s["global_step"] == budget and not s["lost_workers"] and not s["joined_workers"], s


@only_on("mpich", "the lobby's choice is the same under either MPI; hydra's MPI_Finalize is what would wait")
def test_a_spare_that_dies_as_the_job_makes_room_passes_the_loss_to_the_next_spare(tmp_path):
    """np 6 = rank 0 + 3 workers + 2 spares; a worker SIGKILLed from outside; the first spare taken dies
    as the job makes room for it (MPITRAIN_INJECT_SPARE=taken): the job goes on without it, the next phase
    gives the loss to the second spare, and nobody waits in MPI_Finalize for the dead one."""
    budget = 12000
    proc, text, _ = run_and_kill(tmp_path, "--steps", str(budget), "--spares", "2", np_=6, victim=2,
                                 env={"MPITRAIN_INJECT_SPARE": "taken"})
    assert proc.returncode == ExitCode.WORKER_LOST, text  # not 137: a killed worker's supervisor exits 0
    assert "spare rank 4 on" in text and "died when the job had made room; going on with 2 worker(s)" in text, text
    assert "spare rank 5 on" in text and "the spare on" in text and "joined as rank 3" in text, text
    assert "MPI_Finalize still waiting" not in text and "Traceback" not in text, text
    s = read_summary(tmp_path / "s.json", text)
    assert s["global_step"] == budget and len(s["worker_steps"]) == 3, s
    assert [j["spare"] for j in s["joined_workers"]] == [True]


def test_a_job_that_loses_nothing_ends_as_without_spares_and_the_spare_leaves(tmp_path):
    """np 4 with --spares 1: rank 0 and two workers train, the spare waits and leaves at the end: exit 0,
    nothing left running, a summary of two workers."""
    proc = subprocess.run(spares_cmd(tmp_path, "--steps", "300", "--spares", "1", np_=4), capture_output=True,
                          text=True, env=child_env(), timeout=MPI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpitrain: 1 spare(s) waiting: rank 3 on " in proc.stdout, proc.stdout
    s = read_summary(tmp_path / "s.json", proc.stdout + proc.stderr)
    assert len(s["worker_steps"]) == 2 and s["global_step"] == 300 and not s["joined_workers"]


@only_on("mpich", "the line comes before MPI is asked anything; one MPI shows it")
def test_spares_that_leave_no_worker_end_in_one_line_on_every_rank(tmp_path):
    proc = subprocess.run(spares_cmd(tmp_path, "--spares", "2", np_=3), capture_output=True, text=True,
                          env=child_env(), timeout=MPI_TIMEOUT_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "--spares 2 leaves no worker" in line]
    assert len(lines) == 3 and "Traceback" not in proc.stderr, proc.stderr


class _Watch:
    lost: dict = {}


class _Request:
    def Test(self):
        return True


class _Inter:
    def __init__(self):
        self.sent = []

    def Isend(self, spec, dest, tag):
        self.sent.append(tag)
        return _Request()


def test_a_loss_goes_to_a_waiting_spare_before_respawn_and_a_gone_spare_is_not_taken(tmp_path, capsys, monkeypatch):
    """The lobby's choice: a lost worker's place goes to a waiting spare (let in as a joiner that
    connected), --respawn's budget untouched; a spare whose process ended is dropped in one line, and
    with none left the loss goes to --respawn."""
    carry = join.Carry(identity={}, token="t", budget=10, respawns_left=1)
    alive = Spare(_Inter(), 4, "here", 41)
    carry.spares = Pool([Spare(_Inter(), 3, "here", 40), alive], cfg=type("Cfg", (), {"worker_timeout": 2.0})())
    monkeypatch.setattr("mpitrain.membership.spares.dead_here", lambda host, pid: pid == 40)

    class Ctx:
        cfg = type("Cfg", (), {"checkpoint_dir": str(tmp_path), "worker_timeout": 2.0})()
        watch = _Watch()
        stop = StopRequest()  # the stop, or the room made, of this lobby's job alone

    lobby = Lobby(Ctx, carry)
    lobby.check()  # beats the living spare, with the job's budget; drops the dead one
    assert alive.inter.sent and carry.spares.budget == 10 and len(carry.spares) == 1
    Ctx.watch.lost = {2: {"rank": 2}}
    assert lobby._spare_due() and lobby.joiner.pid == 41 and lobby.spare is alive
    assert carry.respawns_left == 1 and len(carry.spares) == 0
    out = capsys.readouterr()
    assert "the spare rank 3 on here (pid 40) is gone (its process has ended)" in out.err
    assert "spare rank 4 on here takes the lost worker's place" in out.out
    lobby = Lobby(Ctx, carry)  # the next phase: another loss, no spare left
    Ctx.watch.lost = {1: {"rank": 1}}
    assert not lobby._spare_due() and lobby._respawn_due() and carry.respawns_left == 0
