"""A worker joins a running job (`--join`, mpitrain/membership/join.py), as a user does it: the job runs, the
same command with `--join` is started under its own mpirun, and the job grows by one worker at a
step boundary: it replaces a worker lost to `kill -9`, or adds one more than the job started with.
A joiner with other flags is refused in one line and changes nothing. MPICH only: Open MPI 5
cannot connect two separately started mpiruns (the joiner says so, exit 2)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    MPI_TIMEOUT_S,
    Lines,
    child_env,
    communicate_or_kill,
    keep_going,
    kill_session,
    launcher,
    mpi_impl,
    mpitrain_cmd,
    only_on,
    wait_for_training,
)

from mpitrain.launch import mpiimpl
from mpitrain.membership import join
from mpitrain.launch.faults import rank_pids
from mpitrain.core.exitcodes import ExitCode

# Long enough that the joiner, which starts in ~1-3 s, finds the job training: measured on 2 cores
# (2026-11-29), it joined at global step 1,513 of async's 6,000 and 299 of sync's 1,400, and 560 in
# place of a killed worker (rank 1 is slowed to 2 ms a step, as alone, after a kill, a worker would
# finish first).
BUDGET = {"async": 6000, "sync": 1400}
JOB = {"async": ("--mode", "async", "--steps", str(BUDGET["async"])),
       "sync": ("--mode", "sync", "--steps", str(BUDGET["sync"]), "--straggler", "1:0.002")}
COMMON = ("--no-progress", "--worker-timeout", "5")  # the joiner's flags must match: the same everywhere

mpich_only = only_on("mpich", "Open MPI 5 cannot connect two separately started mpiruns (join.py)")


def start_job(tmp_path, np_: int, args: tuple[str, ...], common: tuple[str, ...] = COMMON,
              launcher_flags: tuple[str, ...] = (), env: dict | None = None):
    cmd = mpitrain_cmd(np_, *args, *common, "--checkpoint-dir", str(tmp_path / "ck"), "--summary-json",
                       str(tmp_path / "s.json"), launcher_flags=launcher_flags)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or child_env(), start_new_session=True)
    head = wait_for_training(proc, np_)
    return proc, head


def run_joiner(tmp_path, args: tuple[str, ...], timeout: float = MPI_TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = mpitrain_cmd(1, *args, *COMMON, "--checkpoint-dir", str(tmp_path / "ck"), "--join")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())


def finish(proc, head, tmp_path):
    out, err = communicate_or_kill(proc, MPI_TIMEOUT_S)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "\n".join(head) + "\n" + out, err)
    result.leftovers = kill_session(proc)
    summary = tmp_path / "s.json"
    return result, json.loads(summary.read_text()) if summary.exists() else None


@mpich_only
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_joins_a_running_job_and_trains(tmp_path, mode):
    proc, head = start_job(tmp_path, 3, JOB[mode])
    joiner = run_joiner(tmp_path, JOB[mode])
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + job.stderr
    assert joiner.returncode == 0, joiner.stdout + joiner.stderr
    assert job.returncode == 0 and not job.leftovers, out
    assert "Traceback" not in out + joiner.stderr
    assert "joins: making room at the next step boundary" in out
    assert "joined as rank 3 at global step" in out
    assert s["global_step"] == BUDGET[mode]  # the budget the job started with
    assert s["workers"] == 3 and s["worker_ranks"] == [1, 2, 3]
    [joined] = s["joined_workers"]
    assert joined["rank"] == 3 and 0 < joined["global_step"] < BUDGET[mode]
    assert s["gradients_pushed"][2] > 0  # the joiner trained
    assert s["worker_param_digests"] == [s["param_digest"]] * 3 if mode == "sync" else True
    # The counts are of the whole job, not of the phase after the join (as before: the job's own
    # workers had pushed fewer gradients than rank 0 had applied from them, and a sync joiner had
    # taken part in every step), and the job was not resumed from the join's checkpoint.
    if mode == "sync":  # (an Allreduce a step: the exchanges and bytes of the whole job too)
        assert (s["worker_steps"] == s["gradients_pushed"] == s["worker_exchanges"]
                == [BUDGET[mode]] * 2 + [BUDGET[mode] - joined["global_step"]])
        per_exchange = {b / e for (b, _), e in zip(s["worker_bytes"], s["worker_exchanges"])}
        assert len(per_exchange) == 1, s["worker_bytes"]  # the same buffer every step, whoever sent it
    else:
        assert sum(s["worker_steps"]) == BUDGET[mode]
        # the blocks out at the join were dealt again in the next phase (core/ledger.Leases): each applied once
        assert sum(e["samples"] for e in s["epochs"]) == s["global_step"] * s["config"]["batch_size"]
        assert {(e["missed"], e["repeated"]) for e in s["epochs"]} == {(0, 0)}
        assert all(p >= k for p, k in zip(s["gradients_pushed"], s["worker_steps"])), s
    assert s["resumed_from"] is None and "resuming from" not in out
    assert "training on from " in out and ", saved to make room" in out
    assert s["test_accuracy"] > 0.9
    # Its token is gone with the job: a joiner started now is told there is no job.
    assert not (tmp_path / "ck" / join.TOKEN).exists()


@mpich_only
def test_a_joiner_replaces_a_worker_killed_with_sigkill(tmp_path):
    proc, head = start_job(tmp_path, 3, JOB["sync"], launcher_flags=keep_going())
    time.sleep(1)
    os.kill(rank_pids(proc.pid)[2][0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:  # rank 0's word that the worker left goes on alone
        line = proc.stderr.readline()
        lines.append(line)
        if "regrouped" in line or not line:
            break
    assert any("regrouped" in ln for ln in lines), "".join(lines)
    joiner = run_joiner(tmp_path, JOB["sync"])
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + "".join(lines) + job.stderr
    assert joiner.returncode == 0, joiner.stdout + joiner.stderr + out
    assert job.returncode == ExitCode.WORKER_LOST, out  # a worker was lost: exit 8 (hydra: 137)
    assert "Traceback" not in out and not job.leftovers
    assert [x["rank"] for x in s["lost_workers"]] == [2]
    assert s["workers"] == 2 and len(s["joined_workers"]) == 1
    assert s["global_step"] == BUDGET["sync"]
    assert s["worker_param_digests"] == [s["param_digest"]] * 2


@mpich_only
def test_joined_workers_killed_mid_message_are_lost_and_the_job_goes_on(tmp_path):
    """A joined worker's messages travel over MPICH's UCX, which aborted the peer of a process killed
    mid-rendezvous (7 of 13 soak jobs, benchmarks/REJOIN.md) until joins sent eagerly
    (mpiimpl.JOIN_TRANSPORT_ENV): an async joiner pushes and pulls all the time, so a SIGKILL at a
    random moment lands mid-message. Three joins, three kills: rank 0 goes on each time, and the job
    stops on SIGTERM as documented. One outcome besides is documented (docs/elastic.md, UCX's receive
    FIFO; 3 of 75 kills in one soak, 0 of 150 in the next, and once in CI): a joiner killed half-way
    through copying a message into rank 0's UCX queue blocks it, and no later joiner can connect. Then
    that joiner ends in its one line (not a crash: join.gave_up) and the job trains on without it."""
    args = ("--mode", "async", "--dataset", "synthetic", "--steps", "10000000", "--no-progress",
            "--worker-timeout", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    proc = subprocess.Popen(mpitrain_cmd(3, *args, "--summary-json", str(tmp_path / "s.json"),
                                         launcher_flags=keep_going()),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)
    lines, joiners, rng = Lines(proc.stdout), [], random.Random()
    refused = "could not connect to the worker waiting to join"
    try:
        assert lines.wait("rank 2 worker"), lines.text()
        for n in range(1, 4):
            with open(tmp_path / f"joiner-{n}.txt", "w") as out:
                joiners.append(subprocess.Popen(mpitrain_cmd(1, *args, "--join"), stdout=out, stderr=out,
                                                env=child_env(), start_new_session=True))
            # Its phase started (rank 0 announces the ranks again): from here heartbeats see a loss
            # (until then the job's collectives guard it: Carry.start_forming).
            deadline = time.monotonic() + 120
            while lines.count("rank 3 worker") < n and not lines.count(refused) and time.monotonic() < deadline:
                time.sleep(0.05)
            if lines.count(refused):
                assert n > 1, lines.text()  # the first joiner meets a queue no kill has touched
                joiners[-1].wait(MPI_TIMEOUT_S)
                said = (tmp_path / f"joiner-{n}.txt").read_text()
                assert "the job could not connect to this worker; start it again" in said, said
                break
            assert lines.count("rank 3 worker") >= n, lines.text() + (tmp_path / f"joiner-{n}.txt").read_text()
            time.sleep(rng.uniform(0.2, 1.5))
            os.kill(rank_pids(joiners[-1].pid)[0][0], signal.SIGKILL)
            assert lines.wait("; continuing with", n, 60), lines.text()
        proc.send_signal(signal.SIGTERM)  # as scancel does
        proc.wait(MPI_TIMEOUT_S)
    finally:
        leftovers = kill_session(proc)
        for joiner in joiners:
            kill_session(joiner)
    text = lines.text()
    assert proc.returncode == 143 and not leftovers, text
    assert "Traceback" not in text and "cma_ep" not in text and "signal 6" not in text, text
    s = json.loads((tmp_path / "s.json").read_text())
    kills = lines.count("; continuing with")
    assert len(s["joined_workers"]) == kills and len(s["lost_workers"]) == kills, s
    assert kills == 3 or lines.count(refused) == 1, text


@mpich_only
def test_a_joiner_with_other_flags_or_without_the_token_is_refused_and_changes_nothing(tmp_path):
    """Anyone can connect to a port: only a process that read the job's token, with the job's
    flags, gets in. Each refusal is one line on both sides; the job goes on as it was."""
    # Two joiners refused one after the other (~2 s each), the job still training; then stopped as
    # scancel does (a budget it would still be training for took ~8 s more to wait out).
    args = ("--mode", "async", "--steps", "10000000")
    proc, head = start_job(tmp_path, 3, args)
    other = run_joiner(tmp_path, args + ("--hidden", "50"))
    token = tmp_path / "ck" / join.TOKEN
    real = token.read_text()
    token.write_text("0" * 32)  # what the next joiner reads: not the job's
    try:
        stranger = run_joiner(tmp_path, args)
    finally:
        token.write_text(real)
    proc.send_signal(signal.SIGTERM)
    job, s = finish(proc, head, tmp_path)
    assert other.returncode == 2, other.stdout + other.stderr
    assert "the job refused this worker: its flags differ from the job's (layer_sizes" in other.stderr
    assert stranger.returncode == 2, stranger.stdout + stranger.stderr
    assert "did not show this job's token" in stranger.stderr
    assert "Traceback" not in other.stderr + stranger.stderr + job.stderr
    assert job.returncode == 143 and not job.leftovers, job.stdout + job.stderr
    assert job.stdout.count("refused a worker on") == 2
    assert s["workers"] == 2 and s["joined_workers"] == [] and s["lost_workers"] == [] and s["global_step"] > 0


@mpich_only
def test_a_joiner_that_dies_while_the_job_makes_room_is_not_waited_for(tmp_path):
    proc, head = start_job(tmp_path, 3, JOB["async"])
    env = {**child_env(), "MPITRAIN_INJECT_JOIN": "vanish"}
    cmd = mpitrain_cmd(1, *JOB["async"], *COMMON, "--checkpoint-dir", str(tmp_path / "ck"), "--join")
    subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env)
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + job.stderr
    assert job.returncode == 0 and not job.leftovers, out
    # Its process is gone from this host: the job goes on at once, not join.ANSWER_S later.
    assert "died when the job had made room; going on with 2 worker(s)" in out
    assert s["workers"] == 2 and s["joined_workers"] == [] and s["global_step"] == BUDGET["async"]


@mpich_only
def test_a_joiner_the_job_cannot_connect_to_is_given_up_and_the_job_goes_on(tmp_path):
    """A connect to a joiner that is not in accept (MPITRAIN_INJECT_JOIN=deaf) times out, and rank
    0's heartbeats wait meanwhile: each try is bounded by half --worker-timeout (2 s here; a 5 s
    connect lost the job a worker in CI, 2026-11-27). Rank 0 says so in one line and drops the
    request at once (a second connect to that port crashed both processes: join.gave_up), the joiner
    ends in one line, and the job trains on whole."""
    args = ("--mode", "async", "--steps", "10000000", "--no-progress", "--worker-timeout", "2")
    proc, head = start_job(tmp_path, 3, args, common=())
    cmd = mpitrain_cmd(1, *args, "--checkpoint-dir", str(tmp_path / "ck"), "--join")
    joiner = subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S,
                            env={**child_env(), "MPITRAIN_INJECT_JOIN": "deaf"})
    proc.send_signal(signal.SIGTERM)  # as scancel does
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + job.stderr
    # It exits 1 from inside MPI_Comm_accept, without MPI_Finalize: hydra reports that as its own "BAD
    # TERMINATION" (exit 9), nothing mpitrain can change from there.
    assert joiner.returncode != 0, joiner.stdout + joiner.stderr
    assert "the job could not connect to this worker; start it again" in joiner.stderr
    assert job.returncode == 143 and not job.leftovers, out
    gave_up = [ln for ln in out.splitlines() if "could not connect to the worker waiting to join" in ln]
    assert len(gave_up) == 1 and "within 1 s" in gave_up[0] and "start that worker again" in gave_up[0], out
    assert "lost at global step" not in out and "lost the parameter server" not in out, out
    assert s["lost_workers"] == [] and s["workers"] == 2 and s["joined_workers"] == []
    # It read rank 0's mark (join.GAVE_UP) and took it away: nothing of it is left in the folder.
    assert not list((tmp_path / "ck").glob(f"{join.REQUESTS}/*")), list((tmp_path / "ck").rglob("*"))


@mpich_only
def test_rank_0_lost_while_it_lets_a_worker_in_the_joiner_ends_at_once_and_the_job_fails_over(tmp_path):
    """Rank 0 SIGKILLed after it let a joiner in and asked for room (MPITRAIN_INJECT_KILL=0:letin),
    before its GO: the joiner sees that process gone (the folder lock's pid, this host) and ends in
    one line at once, not after its 60 s bound; with --on-lost-server continue the job goes on under a
    successor, which does not take the dead rank 0's request for room for a user's stop (chaos found
    the successor stopping at once, exit 143)."""
    args = ("--mode", "async", "--steps", "10000000", "--no-progress", "--worker-timeout", "1",
            "--on-lost-server", "continue")
    proc, head = start_job(tmp_path, 4, args, common=(), launcher_flags=keep_going(),
                           env={**child_env(), "MPITRAIN_INJECT_KILL": "0:letin"})
    t = time.monotonic()
    joiner = subprocess.run(mpitrain_cmd(1, *args, "--checkpoint-dir", str(tmp_path / "ck"), "--join"),
                            capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=child_env())
    took = time.monotonic() - t
    time.sleep(3)  # the take-over (--worker-timeout 1), then a stop as scancel's
    proc.send_signal(signal.SIGTERM)
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + job.stderr
    assert joiner.returncode != 0 and took < 30, (took, joiner.stdout + joiner.stderr)
    assert "rank 0 was lost while it made room for this worker" in joiner.stderr, joiner.stderr
    assert "Traceback" not in out + joiner.stderr and not job.leftovers, out
    [fo] = s["failovers"]
    assert s["joined_workers"] == [] and s["stopped"]["signal"] == "SIGTERM", out  # our scancel's, only
    assert s["global_step"] > fo["global_step"] + 100, (fo, s["global_step"])  # the successor trained on (the bug: 0)


@mpich_only
def test_a_joiner_that_dies_as_the_new_world_starts_ends_the_job_in_one_line_not_a_hang(tmp_path):
    """From the new world's forming to its phase's heartbeats every rank is in a collective that a
    dead rank never completes, and no heartbeat runs yet: each rank ends itself in one line (exit
    5) once join.FORM_LIMIT_S has passed (5 s here instead of 30: MPITRAIN_FORM_LIMIT_S), and the
    checkpoint saved as the job made room resumes it."""
    limit_s = 5
    limit = {"MPITRAIN_FORM_LIMIT_S": str(limit_s)}
    proc, head = start_job(tmp_path, 3, JOB["async"], launcher_flags=keep_going(), env={**child_env(), **limit})
    env = {**child_env(), **limit, "MPITRAIN_INJECT_JOIN": "formed"}
    cmd = mpitrain_cmd(1, *JOB["async"], *COMMON, "--checkpoint-dir", str(tmp_path / "ck"), "--join")
    subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env)
    t = time.monotonic()
    job, s = finish(proc, head, tmp_path)
    out = job.stdout + job.stderr
    assert time.monotonic() - t < limit_s + 30, out
    assert job.returncode == 5 and not job.leftovers and "Traceback" not in out, out
    stuck = [ln for ln in out.splitlines() if "did not go on within" in ln]
    assert len(stuck) == 3 and all(f"within {limit_s} s" in ln and "(a rank died meanwhile); ending." in ln for ln in stuck), out
    assert s is None  # no summary: the run resumes from the checkpoint
    from mpitrain.duties.checkpoint import list_checkpoints
    assert list_checkpoints(tmp_path / "ck"), out


def test_join_without_a_running_job_says_so(tmp_path):
    joiner = run_joiner(tmp_path, JOB["async"], timeout=120)
    assert joiner.returncode == 2, joiner.stdout + joiner.stderr
    lines = [ln for ln in joiner.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--join" in lines[0] and "Traceback" not in joiner.stderr
    assert ("no running job takes workers" in lines[0]) if mpi_impl().name == "mpich" else ("needs MPICH" in lines[0])


def test_join_needs_the_checkpoint_dir(tmp_path):
    cmd = mpitrain_cmd(1, "--join", "--no-progress")
    joiner = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    assert joiner.returncode == 2 and "--join finds the running job through its folder" in joiner.stderr


@pytest.mark.parametrize("flags", [("--checkpoint-dir", "ck"), (), ("--worker-timeout", "0")])
def test_the_transport_settings_are_made_before_mpi_starts(tmp_path, flags):
    """MPI reads its settings once, at MPI_Init: mpiimpl.JOIN_TRANSPORT_ENV (a job that can take
    joiners, under MPICH's mpirun on one host) and LOSS_TRANSPORT_ENV (a job with heartbeats, which
    goes on after a lost rank; srun too, so under any launcher) must be in the environment when
    mpi4py.MPI is first imported (which initialises MPI), and only there. Seen from inside the
    process."""
    names = [*mpiimpl.JOIN_TRANSPORT_ENV, *mpiimpl.LOSS_TRANSPORT_ENV]
    probe = (
        "import os, sys\n"
        "seen = []\n"
        "class Probe:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mpi4py.MPI' and not seen:\n"
        f"            seen.extend(os.environ.get(n) for n in {names!r})\n"
        "sys.meta_path.insert(0, Probe())\n"
        "from mpitrain import cli\n"
        f"code = cli.main(['--steps', '2', '--no-progress', *{list(flags)!r}])\n"
        "print('SEEN', seen)\n"
    )
    env = {k: v for k, v in child_env().items() if k not in names}
    joins = mpi_impl().name == "mpich" and "--checkpoint-dir" in flags
    losses = [*mpiimpl.LOSS_TRANSPORT_ENV.values()] if "--worker-timeout" not in flags else [None]
    expected = [*(mpiimpl.JOIN_TRANSPORT_ENV.values() if joins else [None]), *losses]
    for cmd in ([*launcher(), "-np", "1", sys.executable, "-c", probe], [sys.executable, "-c", probe]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert f"SEEN {expected!r}" in out.stdout, out.stdout + out.stderr
        expected = [None, *losses]  # without mpirun no joins: no port to reach, no hydra to say where the ranks are
