"""A rank SIGKILLed from outside at random moments of start-up or of the run's end, many times (issue 82).

    python benchmarks/startup_kills.py [--trials 40] [--window 1.5] [--out benchmarks/STARTUP_KILLS.md]
    python benchmarks/startup_kills.py --at end [--trials 40] [--window 0.4] [--out benchmarks/STARTUP_KILLS.md]

Each trial starts `mpirun <keep-going> -np 4 python -m mpitrain` with a start-up made long enough to
land in (60,000 synthetic examples made by every rank before the setup agreement), waits for rank 2's
training process to appear, SIGKILLs it after a random 0..WINDOW s, and sorts the ending: `start-up`
(the job ended with its documented line: MPICH's supervisor, Open MPI's one line per rank or the
MPI_Init watch), `lost worker` (the kill came after the first heartbeats: the job finished its budget,
exit 8), or a failure (a hang past 120 s, a traceback, a leftover process, another exit).

--at end: rank 0's log is read, and once it has made 80% of the budget a random rank (rank 0 too) is
SIGKILLed after a random 0..WINDOW s: in its last steps, its final checkpoint, its summary, the reports, the
farewell, MPI_Finalize. The endings documented in docs/lost-ranks.md: `lost worker` (exit 8, the summary),
`after the summary` (a rank gone once the summary was written: exit 0 or 8, MPICH's mpirun 137 for rank 0's),
`lost rank 0` (before its summary: every worker says it lost the parameter server, a non-zero exit),
`ended first` (the rank had exited before the kill). Every checkpoint left must load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import env as bench_env  # noqa: E402  (same folder)
from run import machine, mpirun  # noqa: E402

from support import faults, mpiimpl  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)

ARGS = ("--dataset", "synthetic", "--synthetic-samples", "60000", "--steps", "2000", "--no-progress",
        "--worker-timeout", "1")
SAID = ("during start-up, before the job could go on without it", "a rank was lost while the job started")
END_ARGS = ("--dataset", "synthetic", "--steps", "3000", "--worker-timeout", "2", "--checkpoint-every-steps", "1000",
            "--log-every", "50", "--no-progress")
LOST_PS = "lost the parameter server"


def trial(impl, rng: random.Random, window: float, summary: Path) -> tuple[str, float, float]:
    summary.unlink(missing_ok=True)
    cmd = [mpirun(), *mpiimpl.local_flags(impl), *impl.keep_going, "-np", "4", sys.executable, "-m", "mpitrain",
           *ARGS, "--summary-json", str(summary)]
    env = {**bench_env(), **mpiimpl.local_env(impl)}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    delay = rng.uniform(0.0, window)
    deadline = time.monotonic() + 60
    pid = None
    while pid is None and time.monotonic() < deadline:
        pid = (faults.rank_pids(job.pid).get(2) or (None,))[0]
        time.sleep(0.02)
    time.sleep(delay)
    _, ended = kill_and_wait(job, pid)
    if ended is None:
        return "hang", delay, 120.0
    err, took, left = ended
    if "Traceback" in err or left:
        return "traceback" if "Traceback" in err else "leftover", delay, took
    if summary.exists() and job.returncode == 8:
        return "lost worker", delay, took
    if job.returncode != 0 and any(s in err for s in SAID):
        return "start-up", delay, took
    return f"exit {job.returncode}", delay, took


def kill_and_wait(job: subprocess.Popen, pid: int | None) -> tuple[bool, tuple[str, float, bool] | None]:
    """SIGKILL `pid` (None: not found) and wait for the job: (whether the kill hit a live process, then its
    output (standard error, then standard output), the seconds from the kill to its end and whether any
    process of it was left; None when it hung 120 s, its processes then killed)."""
    hit = False
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            hit = True
        except ProcessLookupError:
            pass
    killed = time.monotonic()
    try:
        out, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        faults.kill_session(job.pid, 0.0)
        return hit, None
    return hit, (err + out, time.monotonic() - killed, faults.kill_session(job.pid, faults.LINGER_S))


def end_trial(impl, rng: random.Random, window: float, summary: Path, ckpt: Path) -> tuple[str, float, float]:
    """One kill in the run's last moments (--at end): the ending, the delay after 80% of the budget, the time
    from the kill to the job's end."""
    summary.unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)  # a fresh job each time, never a resume of the last
    ckpt.mkdir()
    cmd = [mpirun(), *mpiimpl.local_flags(impl), *impl.keep_going, "-np", "4", sys.executable, "-m", "mpitrain",
           *END_ARGS, "--checkpoint-dir", str(ckpt), "--log-dir", str(ckpt / "log"), "--summary-json", str(summary)]
    env = {**bench_env(), **mpiimpl.local_env(impl)}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    # rank 0's log, not its bar: Open MPI's launcher forwards a rank's output in late chunks
    budget, events = int(END_ARGS[END_ARGS.index("--steps") + 1]), ckpt / "log" / "events.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None and logged_step(events) < 0.8 * budget:
        time.sleep(0.005)
    delay, victim = rng.uniform(0.0, window), rng.randrange(4)
    time.sleep(delay)
    hit, ended = kill_and_wait(job, (faults.rank_pids(job.pid).get(victim) or (None,))[0])
    if ended is None:
        return "hang", delay, 120.0
    text, took, left = ended
    ended_first = not hit
    bad = unloadable(ckpt)
    if "Traceback" in text or left or bad:
        return ("traceback" if "Traceback" in text else "leftover" if left else f"checkpoint {bad} unreadable"), delay, took
    rc, wrote = job.returncode, summary.exists()
    if ended_first:
        return ("ended first" if rc == 0 else f"ended first, exit {rc}"), delay, took
    if victim > 0 and wrote and rc == 8:
        return "lost worker", delay, took
    if wrote and (rc in (0, 8) or (victim == 0 and rc == 128 + signal.SIGKILL)):
        return "after the summary", delay, took
    if victim == 0 and not wrote and rc != 0 and text.count(LOST_PS) >= 1:
        return "lost rank 0", delay, took
    return f"rank {victim}: exit {rc}{'' if wrote else ', no summary'}", delay, took


def logged_step(events: Path) -> int:
    """The newest global step in rank 0's log (0: none yet)."""
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        if '"global_step"' in line:
            try:
                return int(json.loads(line)["global_step"])
            except (ValueError, KeyError):
                continue  # a line still being written
    return 0


def unloadable(ckpt: Path) -> str | None:
    """The first checkpoint left in the folder that does not load (a kill must never corrupt one), or None."""
    import numpy as np

    for path in sorted(ckpt.glob("*.npz")):
        try:
            with np.load(path, allow_pickle=False) as z:
                z["params"]
        except Exception:  # noqa: BLE001  (any failure to read is the finding)
            return path.name
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--window", type=float, default=None, help="default: 1.5 s (start), 0.4 s (end)")
    p.add_argument("--at", choices=("start", "end"), default="start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    impl = mpiimpl.of_mpirun(mpirun())
    rng = random.Random(a.seed)
    end = a.at == "end"
    window = a.window if a.window is not None else (0.4 if end else 1.5)
    rows = []
    summary = Path(f"/tmp/startup-kills-{os.getpid()}.json")
    ckpt = Path(f"/tmp/startup-kills-{os.getpid()}-ckpt")
    for i in range(a.trials):
        rows.append(end_trial(impl, rng, window, summary, ckpt) if end else trial(impl, rng, window, summary))
        print(f"[{i + 1}/{a.trials}] kill at {rows[-1][1]:.2f} s -> {rows[-1][0]} ({rows[-1][2]:.1f} s to end)", flush=True)
    kinds = sorted({r[0] for r in rows})
    documented = ("lost worker", "after the summary", "lost rank 0", "ended first") if end else ("start-up", "lost worker")
    good = sum(r[0] in documented for r in rows)
    what = ("A random rank (rank 0 too) SIGKILLed 0..window s after rank 0's log showed 80% of a 3,000-step budget, "
            "`mpirun` with the keep-going flag, np 4, `--worker-timeout 2`, a checkpoint every 1,000 steps and the "
            "final one; every checkpoint left loaded." if end else
            "A worker SIGKILLed 0..window s after its process appeared, `mpirun` with the keep-going flag, np 4, "
            "`--worker-timeout 1`, every rank making 60,000 synthetic examples before the setup agreement.")
    kind = "Shutdown" if end else "Start-up"
    lines = [f"# {kind} kills, {impl.title} ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"`python benchmarks/startup_kills.py --at {a.at} --trials {a.trials} --window {window} --seed {a.seed}`; "
             f"{machine()}.", "",
             what, "", f"**{good} of {a.trials} as documented** (docs/lost-ranks.md, the {kind.lower()} rows).", "",
             "| ending | trials | median s from the kill to the end |", "|---|---|---|"]
    for k in kinds:
        ts = [r[2] for r in rows if r[0] == k]
        lines.append(f"| {k} | {len(ts)} | {statistics.median(ts):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        record(a.out, text)
    return 0 if good == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
