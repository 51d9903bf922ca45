"""The jobs/*.sbatch scripts, submitted to a real single-node Slurm that this test brings up."""

import json
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, Unavailable

ROOT = Path(__file__).resolve().parent.parent
CPU_JOBS = ["async", "sync", "sync-quorum"]
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Unavailable as e:
        cluster.stop()
        pytest.skip(f"no real Slurm here: {e}")
    yield cluster
    cluster.stop()


def job_env(args: str) -> dict:
    return {"MPITRAIN_VENV": sys.prefix, "MPITRAIN_ARGS": args, "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("name", CPU_JOBS)
def test_job_script_completes_and_learns(slurm, tmp_path, name):
    job = slurm.submit(ROOT / "jobs" / f"{name}.sbatch", tmp_path, job_env("--epochs 20"))
    info = slurm.wait(job)
    out = (tmp_path / f"mpitrain-{job}.out").read_text() if (tmp_path / f"mpitrain-{job}.out").exists() else ""
    assert info["JobState"] == "COMPLETED", f"{info.get('JobState')} {info.get('ExitCode')}\n{out}"
    summary = json.loads((tmp_path / "runs" / str(job) / "summary.json").read_text())
    assert summary["world_size"] == (4 if name == "sync-quorum" else 3)  # one MPI world, not N singletons
    assert summary["test_accuracy"] >= 0.85
    assert summary["mode"] == ("async" if name == "async" else "sync")
    if name == "sync-quorum":
        assert summary["quorum"] == 2
    assert (tmp_path / "runs" / str(job) / "train.log").read_text().count("mpitrain done") == 1


def test_bad_submission_fails_with_the_trainers_message(slurm, tmp_path):
    job = slurm.submit(ROOT / "jobs" / "sync-quorum.sbatch", tmp_path, job_env("--quorum 9"))
    info = slurm.wait(job)
    assert info["JobState"] == "FAILED"
    out = (tmp_path / f"mpitrain-{job}.out").read_text()
    assert "mpitrain: error: --quorum 9 is more than the 3 worker(s)" in out
    assert "Traceback" not in out


def test_plain_srun_without_pmi_is_refused(slurm, tmp_path):
    script = tmp_path / "bad.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=bad-%j.out\n"
                      f"srun --mpi=none {sys.executable} -m mpitrain --no-progress --steps 5\n")
    job = slurm.submit(script, tmp_path, {})
    info = slurm.wait(job)
    assert info["JobState"] == "FAILED"
    assert "--mpi=pmi2" in (tmp_path / f"bad-{job}.out").read_text()


def test_chained_job_resumes_from_the_shared_checkpoint_dir(slurm, tmp_path):
    env = {**job_env("--mode sync --optimizer adam --lr 0.01"), "MPITRAIN_CKPT_DIR": str(tmp_path / "ck")}
    first = slurm.submit(ROOT / "jobs" / "sync.sbatch", tmp_path, env, "--steps", "20")
    second = slurm.submit(ROOT / "jobs" / "sync.sbatch", tmp_path, env, "--steps", "40",
                          sbatch_args=[f"--dependency=afterany:{first}"])
    assert slurm.wait(first)["JobState"] == "COMPLETED"
    assert slurm.wait(second)["JobState"] == "COMPLETED"
    s = json.loads((tmp_path / "runs" / str(second) / "summary.json").read_text())
    assert s["resumed_from"].endswith("ckpt-000000020.npz") and s["global_step"] == 40
    assert (tmp_path / "ck" / "ckpt-000000040.npz").exists()


def _task_pid(job: int, task: int) -> int | None:
    """The pid of task TASK of Slurm job JOB (its python process), from /proc."""
    import os

    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if b"mpitrain" in cmd and f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_PROCID={task}".encode() in env:
            return int(entry)
    return None


@pytest.mark.parametrize("how", ["injected", "from outside"])
def test_async_job_finishes_without_a_task_killed_mid_training(slurm, tmp_path, how):
    """srun --kill-on-bad-exit=0 --no-kill (jobs/async.sbatch): rank 0 finishes the budget with
    the worker left when the other one is SIGKILLed (no supervisor under srun)."""
    import os
    import random
    import signal
    import time

    env = job_env("--steps 6000 --worker-timeout 2")
    if how == "injected":
        env["MPITRAIN_INJECT_KILL"] = "2:50"
    else:
        env["MPITRAIN_ARGS"] = "--steps 15000 --worker-timeout 2"
    job = slurm.submit(ROOT / "jobs" / "async.sbatch", tmp_path, env)
    if how == "from outside":
        out_file = tmp_path / f"mpitrain-{job}.out"
        deadline = time.time() + 120
        while time.time() < deadline and "rank 2 worker" not in (out_file.read_text() if out_file.exists() else ""):
            time.sleep(0.1)  # rank 0 lists the ranks once every one has started: training is next
        time.sleep(random.uniform(0.2, 1.5))
        pid = _task_pid(job, 2)
        assert pid is not None, "task 2 not found"
        os.kill(pid, signal.SIGKILL)
    info = slurm.wait(job)
    out = (tmp_path / f"mpitrain-{job}.out").read_text()
    summary = json.loads((tmp_path / "runs" / str(job) / "summary.json").read_text())
    assert [w["rank"] for w in summary["lost_workers"]] == [2], out
    assert summary["global_step"] == (6000 if how == "injected" else 15000) and summary["worker_ranks"] == [1]
    assert "worker rank 2 lost at global step" in out and "Traceback" not in out
    assert info["JobState"] == "FAILED"  # the dead task's exit code is the step's
