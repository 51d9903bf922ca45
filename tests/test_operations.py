"""What a cluster user does every day, done as users do it: Ctrl-C, `kill -TERM` of mpirun or of
one rank, Slurm's SIGUSR1 before the time limit, the same command run again after it finished,
two jobs on one folder. Each ends cleanly, saves, resumes, and never mixes runs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from conftest import (
    MPI_TIMEOUT_S,
    NUMBERS_ONLY,
    OWN_LOGIC,
    child_env,
    communicate_or_kill,
    mpitrain_cmd,
    only_on,
    run_mpitrain,
    wait_for_training,
)

from mpitrain.core.config import UsageError
from mpitrain.duties import plot
from mpitrain.launch import lock
from mpitrain.launch.faults import rank_pids
from mpitrain.launch.mpiimpl import OPENMPI

LONG = ("--dataset", "synthetic", "--steps", "1000000", "--no-progress")  # never reached: the signal ends it
STOP_WITHIN_S = 20  # from the signal to the end of the job, the final checkpoint and summary included


def start(np_: int, *args: str) -> subprocess.Popen:
    cmd = mpitrain_cmd(np_, *args) if np_ else [sys.executable, "-m", "mpitrain", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)


def signal_target(proc: subprocess.Popen, target: str, sig: int) -> None:
    """'launcher': mpirun itself (or the one process); 'rank N': that rank's training process."""
    if target == "launcher":
        os.kill(proc.pid, sig)
        return
    rank = int(target.split()[1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = rank_pids(proc.pid)
        if rank in found:
            os.kill(found[rank][0], sig)
            return
        time.sleep(0.05)
    pytest.fail(f"no training process of rank {rank} found")


STOP_LINE = re.compile(r"^mpitrain stopped \((SIG\w+)\) at global step ([\d,]+) \(from rank \d+: SIG\w+ received\); "
                       r"the newest checkpoint is (\S+); resume with the same command$", re.M)

CASES = {
    "async, SIGTERM to mpirun": (3, "launcher", signal.SIGTERM, ()),
    "sync, Ctrl-C to mpirun": (3, "launcher", signal.SIGINT, ("--mode", "sync")),
    "sync, SIGTERM to rank 0 alone": (3, "rank 0", signal.SIGTERM, ("--mode", "sync")),
    "quorum, SIGTERM to a worker alone": (4, "rank 3", signal.SIGTERM, ("--mode", "sync", "--quorum", "2")),
    "async --num-ps 2, SIGINT to server 1 alone": (5, "rank 1", signal.SIGINT, ("--num-ps", "2")),
    "one process, Slurm's SIGUSR1": (0, "launcher", signal.SIGUSR1, ()),
    # Open MPI's mpirun passes SIGUSR1 on to every rank and waits for them (under MPICH it is hydra's
    # notice of a dead peer: see test_sigusr1_stops_a_run_except_under_hydra_where_it_means_a_dead_peer)
    "async, SIGUSR1 to Open MPI's mpirun": (3, "launcher", signal.SIGUSR1, ()),
}


# A signal to mpirun goes through the launcher, and one to rank 0 alone makes a rank exit while its
# launcher watches: both MPIs. A worker or a server alone is the same path for another rank, and one
# process has no launcher: MPICH only.
ONE_MPI_CASES = {"quorum, SIGTERM to a worker alone", "async --num-ps 2, SIGINT to server 1 alone",
                 "one process, Slurm's SIGUSR1"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=only_on("mpich", OWN_LOGIC)) if c in ONE_MPI_CASES else c
                                  for c in CASES])
def test_a_signal_stops_at_a_step_saves_and_resumes(tmp_path, case, mpi):
    np_, target, sig, flags = CASES[case]
    if "Open MPI" in case and mpi is not OPENMPI:
        pytest.skip("Open MPI only: hydra keeps SIGUSR1 as its notice of a dead peer")
    # prterun SIGTERMs the ranks on SIGTERM or SIGINT, drops their output and exits 1 (mpiimpl.Impl.stop_exit)
    by_prterun = np_ > 0 and target == "launcher" and sig != signal.SIGUSR1 and mpi.stop_exit is not None
    ck, summary = tmp_path / "ck", tmp_path / "s.json"
    args = (*LONG, *flags, "--checkpoint-dir", str(ck), "--summary-json", str(summary))
    proc = start(np_, *args)
    wait_for_training(proc, max(np_, 1))
    time.sleep(1.0)  # well inside training
    signal_target(proc, target, sig)
    t0 = time.monotonic()
    out, err = communicate_or_kill(proc)
    assert time.monotonic() - t0 < STOP_WITHIN_S
    assert proc.returncode == (mpi.stop_exit if by_prterun else 128 + sig), f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in out + err and "BAD TERMINATION" not in out + err
    if by_prterun:  # the line is lost with the ranks' output; the summary says it
        stopped = json.loads(summary.read_text())["stopped"]
        found = [("SIGTERM", str(stopped["global_step"]), stopped["resume"].split()[4].rstrip(";"))]
        sig = signal.SIGTERM
    else:
        found = STOP_LINE.findall(out)
    assert len(found) == 1, out  # one line per job
    name, step, newest = found[0]
    step = int(step.replace(",", ""))
    assert name == signal.Signals(sig).name and 0 < step < 1_000_000
    assert newest.endswith(f"ckpt-{step:09d}.npz") and os.path.exists(newest)  # the final state, saved
    s = json.loads(summary.read_text())
    assert s["stopped"]["signal"] == name and s["stopped"]["global_step"] == step == s["global_step"]
    # where it began: the rank signalled (a signal to the launcher reaches every rank: any of them)
    who = target.split()[1] if target.startswith("rank") else r"\d+"
    assert re.fullmatch(rf"rank {who}: {name} received", s["stopped"]["origin"]), s["stopped"]
    # The same command (a shorter budget, to keep the test short) goes on from there.
    resumed = tmp_path / "r.json"
    proc = run_mpitrain(np_, *LONG[:2], *flags, "--no-progress", "--steps", str(step + 30), "--checkpoint-dir",
                        str(ck), "--summary-json", str(resumed))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(resumed.read_text())
    assert r["resumed_from"] == newest and r["global_step"] == step + 30 and r["stopped"] is None


@only_on("mpich", NUMBERS_ONLY)
def test_a_sync_run_stopped_by_a_signal_resumes_bit_exact(tmp_path, mpi):
    """The chief's exact state is saved: stopped and resumed ends where one uninterrupted run ends."""
    # Paced (a sleep only: the numbers are the same) so that the signal 0.3 s in lands mid-run: unpaced, an AMD
    # EPYC VM trained all 2,500 steps in 0.29 s and the signal came after the end (clean-clone CI, 2026-12-05).
    flags = ("--mode", "sync", "--no-progress", "--steps", "2500", "--straggler", "1:0.0005")
    whole = tmp_path / "whole.json"
    proc = run_mpitrain(3, *flags, "--summary-json", str(whole))
    assert proc.returncode == 0, proc.stderr
    ck, first, second = tmp_path / "ck", tmp_path / "1.json", tmp_path / "2.json"
    proc = start(3, *flags, "--checkpoint-dir", str(ck), "--summary-json", str(first))
    wait_for_training(proc, 3)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = communicate_or_kill(proc)
    assert proc.returncode == (mpi.stop_exit or 143), out + err
    stopped_at = json.loads(first.read_text())["stopped"]["global_step"]
    assert stopped_at < 2500, "the signal came after the run ended: nothing was tested"
    proc = run_mpitrain(3, *flags, "--checkpoint-dir", str(ck), "--summary-json", str(second))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(second.read_text())["param_digest"] == json.loads(whole.read_text())["param_digest"]


RERUNS = {
    "async --epochs": (3, ("--epochs", "2")),
    "sync --steps": (3, ("--mode", "sync", "--steps", "200")),
    "async --num-ps 2 --steps": (4, ("--num-ps", "2", "--steps", "200")),
    "one process --steps": (0, ("--steps", "200")),
}


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("case", list(RERUNS))
def test_running_a_finished_job_again_changes_nothing(tmp_path, case):
    np_, flags = RERUNS[case]
    ck = tmp_path / "ck"
    first, again = tmp_path / "1.json", tmp_path / "2.json"
    base = ("--no-progress", "--checkpoint-dir", str(ck), *flags)
    proc = run_mpitrain(np_, *base, "--summary-json", str(first))
    assert proc.returncode == 0, proc.stderr
    done = json.loads(first.read_text())
    files = {p.name: p.stat().st_mtime_ns for p in ck.iterdir()}
    for extra in ((), ("--steps", "100")):  # the same command (a requeue, an afterany chain), or a smaller budget
        proc = run_mpitrain(np_, *base, *extra, "--summary-json", str(again))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        text = again.read_text()
        assert "NaN" not in text and "Infinity" not in text
        s = json.loads(text)
        assert s["trained"] is False and s["global_step"] == done["global_step"]
        assert s["samples_per_second"] is None and s["final_loss"] is None and s["checkpoints"] == []
        assert s["test_accuracy"] == done["test_accuracy"] and set(s) == set(done)
        assert "nothing was trained" in proc.stdout and "samples/s" not in proc.stdout
        assert {p.name: p.stat().st_mtime_ns for p in ck.iterdir()} == files  # no new checkpoint, none pruned


@only_on("mpich", NUMBERS_ONLY)
def test_a_resumed_async_run_stops_exactly_at_the_budget(tmp_path):
    ck = tmp_path / "ck"
    for steps in (200, 300):
        s = tmp_path / f"{steps}.json"
        proc = run_mpitrain(3, "--no-progress", "--steps", str(steps), "--checkpoint-dir", str(ck),
                            "--summary-json", str(s))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(s.read_text())["global_step"] == steps


@only_on("mpich", NUMBERS_ONLY)
def test_a_second_job_on_the_same_folder_is_refused(tmp_path, mpi):
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    first = start(3, *LONG, "--checkpoint-dir", str(ck), "--log-dir", str(logs))
    wait_for_training(first, 3)
    deadline = time.monotonic() + 30
    while not (logs / "events.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        for flag, folder in (("--checkpoint-dir", ck), ("--log-dir", logs)):
            events = (logs / "events.jsonl").read_text()
            proc = run_mpitrain(3, "--no-progress", flag, str(folder), timeout=60)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            lines = [x for x in proc.stderr.splitlines() if x.startswith("mpitrain")]
            assert len(lines) == 1 and f"{flag} {folder} is in use by another mpitrain job" in lines[0]
            assert f"pid {first.pid}" not in lines[0] and "host" in lines[0] and "Traceback" not in proc.stderr
            assert (logs / "events.jsonl").read_text().startswith(events)  # the refused job wrote nothing there
    finally:
        stop = signal.Signals[mpi.stop_signal]
        os.kill(first.pid, stop)
        out, err = communicate_or_kill(first)
    assert first.returncode == 128 + stop, out + err
    assert not (ck / lock.NAME).exists() and not (logs / lock.NAME).exists()  # released on the way out


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / lock.NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "proc_start": "1",
                                            "started": "earlier"}))
    proc = run_mpitrain(0, "--no-progress", "--steps", "20", "--checkpoint-dir", str(ck))
    assert proc.returncode == 0, proc.stderr
    assert f"took over the stale lock of pid {gone.pid} on this host, which has ended" in proc.stderr
    assert not (ck / lock.NAME).exists()


def test_a_live_owner_keeps_its_lock_and_a_requeued_job_takes_its_own(tmp_path):
    mine = lock.owner_record()
    held = tmp_path / "held"
    held.mkdir()
    (held / lock.NAME).write_text(json.dumps({**mine, "slurm_job_id": None}))  # this very process: alive
    with pytest.raises(UsageError, match="is in use by another mpitrain job"):
        lock.FolderLock("--log-dir", held).acquire()
    other_host = {**mine, "host": "elsewhere", "slurm_job_id": "77"}
    assert lock.owner_gone(other_host, {**mine, "slurm_job_id": None}) is None  # cannot tell: refused
    assert "requeued" in lock.owner_gone(other_host, {**mine, "slurm_job_id": "77"})


@only_on("mpich", NUMBERS_ONLY)
def test_a_new_run_in_an_old_log_dir_is_kept_apart(tmp_path):
    logs = tmp_path / "logs"
    for _ in range(2):
        proc = run_mpitrain(0, "--no-progress", "--steps", "40", "--log-every", "10", "--log-dir", str(logs))
        assert proc.returncode == 0, proc.stderr
    assert "the earlier run's events moved to" in proc.stdout
    starts = [e for e in map(json.loads, (logs / "events.jsonl").read_text().splitlines()) if e["event"] == "start"]
    assert len(starts) == 1
    (old,) = list(logs.glob("superseded-*"))
    assert (old / "events.jsonl").is_file()


@only_on("mpich", NUMBERS_ONLY)
def test_the_plot_drops_what_a_resumed_run_redid(tmp_path):
    """A run killed at step 80 after its checkpoint at 50, resumed from 50: one line, never back."""
    events = [{"event": "start", "start_step": 0, "mode": "sync"}]
    events += [{"event": "train", "global_step": s, "seconds": s / 10, "loss": 1.0} for s in range(10, 90, 10)]
    events += [{"event": "start", "start_step": 50, "mode": "sync"}]
    events += [{"event": "train", "global_step": s, "seconds": (s - 50) / 10, "loss": 0.5} for s in range(60, 130, 10)]
    (tmp_path / "events.jsonl").write_text("\n".join(map(json.dumps, events[:9])) + "\n{\"event\": \"tra\n"
                                           + "\n".join(map(json.dumps, events[9:])) + "\n")
    run = plot.read_run(str(tmp_path))
    steps = [e["global_step"] for e in run["train"]]
    seconds = [e["seconds"] for e in run["train"]]
    assert steps == list(range(10, 130, 10))
    assert seconds == sorted(seconds)


@only_on("mpich", NUMBERS_ONLY)
def test_what_mpitrain_writes_is_readable_as_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        s, ck = tmp_path / "s.json", tmp_path / "ck"
        proc = run_mpitrain(0, "--no-progress", "--steps", "20", "--checkpoint-dir", str(ck), "--summary-json", str(s))
        assert proc.returncode == 0, proc.stderr
    finally:
        os.umask(old)
    for path in [s, *ck.glob("ckpt-*.npz")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_second_signal_while_stopping_does_not_corrupt_anything(tmp_path, mpi):
    """Hydra itself forwards each signal twice (measured); a user presses Ctrl-C again (Open MPI:
    its graceful stop signal, SIGUSR1; a second SIGTERM makes prterun kill every rank at once)."""
    stop = signal.Signals[mpi.stop_signal]
    ck = tmp_path / "ck"
    proc = start(3, *LONG, "--model", "mlp", "--hidden", "2000", "--checkpoint-dir", str(ck))
    wait_for_training(proc, 3)
    time.sleep(1.0)
    for _ in range(3):
        os.kill(proc.pid, stop)
        time.sleep(0.05)
    out, err = communicate_or_kill(proc, MPI_TIMEOUT_S)
    assert proc.returncode == 128 + stop and "Traceback" not in err, out + err
    from mpitrain.duties.checkpoint import list_checkpoints, load

    found = list_checkpoints(ck)
    assert found and load(found[-1]).global_step == int(STOP_LINE.findall(out)[0][1].replace(",", ""))
    assert not list(ck.glob(".*.tmp"))


@only_on("mpich", "one process, no launcher: the same under either MPI")
def test_a_signal_as_the_run_ends_changes_nothing(tmp_path):
    """Signals that land after the summary (while MPI finalizes and Python shuts down) neither kill
    the process nor change its exit code (chaos: 2 of 66 trials exited 143 after 'done')."""
    for _ in range(3):
        proc = start(0, "--no-progress", "--steps", "30")
        line = " "
        while line and not line.startswith("mpitrain done"):
            line = proc.stdout.readline()
        while proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        out, err = communicate_or_kill(proc)
        assert proc.returncode == 0, out + err


def test_sigusr1_stops_a_run_except_under_hydra_where_it_means_a_dead_peer():
    from mpitrain.membership.stopping import handled

    assert signal.SIGUSR1 in handled({}) and signal.SIGUSR1 in handled({"PMI_FD": "9"})  # one process; srun
    assert set(handled({"PMI_FD": "9", "MPI_LOCALRANKID": "0"})) == {signal.SIGINT, signal.SIGTERM}  # mpirun


def test_room_made_for_a_new_member_is_not_a_stop_and_spreads_as_room():
    """Rank 0 making room for a joiner, a spare or a replacement ends the phase (`due`) but is no stop:
    it goes on the wire as ROOM, a peer hears room and not a stop, the new world's phase clears it, and a
    user's stop (a signal, or a peer's word of one whose signal it does not know) outranks it and stays.
    They shared one flag, told apart only by a known signal number."""
    from mpitrain.core.stop import ROOM, UNKNOWN, StopRequest

    rank0, worker = StopRequest(), StopRequest()
    rank0.make_room()
    assert rank0.due and not rank0.requested and rank0.since is None and rank0.wire == ROOM
    worker.heard(rank0.wire)
    assert worker.due and worker.room and not worker.requested
    worker.heard(UNKNOWN)  # meanwhile another worker's word of a user's stop
    assert worker.requested and worker.wire == UNKNOWN  # a stop outranks room on the wire
    worker.room_made()
    assert worker.requested and worker.due and not worker.room  # the phase after the regroup stops too
    rank0.request(int(signal.SIGTERM))
    rank0.room_made()
    assert rank0.wire == int(signal.SIGTERM)


def test_a_signal_long_after_room_was_made_is_the_first_stop_request_not_a_second(monkeypatch):
    """A second signal FORCE_AFTER_S after the first ends the process without a checkpoint. Room made for a
    joiner is no first signal: a Ctrl-C during a long regroup must still save (the shared flag's first
    request set the clock)."""
    from types import SimpleNamespace

    from mpitrain.core.stop import STOP
    from mpitrain.membership import stopping

    restore = stopping.install()
    try:
        STOP.make_room()
        forced = []
        monkeypatch.setattr(stopping, "force_exit", forced.append)
        later = time.monotonic() + 2 * stopping.FORCE_AFTER_S
        monkeypatch.setattr(stopping, "time", SimpleNamespace(monotonic=lambda: later))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert not forced and STOP.requested and STOP.signum == signal.SIGTERM
    finally:
        restore()
        STOP.reset()
