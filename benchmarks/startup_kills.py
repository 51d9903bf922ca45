"""A worker SIGKILLed from outside at random moments of start-up, many times (issue 82).

    python benchmarks/startup_kills.py [--trials 40] [--window 1.5] [--out benchmarks/STARTUP_KILLS.md]

Each trial starts `mpirun <keep-going> -np 4 python -m mpitrain` with a start-up made long enough to
land in (60,000 synthetic examples made by every rank before the setup agreement), waits for rank 2's
training process to appear, SIGKILLs it after a random 0..WINDOW s, and sorts the ending: `start-up`
(the job ended with its documented line: MPICH's supervisor, Open MPI's one line per rank or the
MPI_Init watch), `lost worker` (the kill came after the first heartbeats: the job finished its budget,
exit 8), or a failure (a hang past 120 s, a traceback, a leftover process, another exit).
"""

from __future__ import annotations

import argparse
import os
import random
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

from mpitrain.launch import mpiimpl  # noqa: E402
from mpitrain.membership import faults  # noqa: E402

ARGS = ("--dataset", "synthetic", "--synthetic-samples", "60000", "--steps", "2000", "--no-progress",
        "--worker-timeout", "1")
SAID = ("during start-up, before the job could go on without it", "a rank was lost while the job started")


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
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        _, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        faults.kill_session(job.pid, 0.0)
        return "hang", delay, 120.0
    took = time.monotonic() - killed
    left = faults.kill_session(job.pid, faults.LINGER_S)
    if "Traceback" in err or left:
        return "traceback" if "Traceback" in err else "leftover", delay, took
    if summary.exists() and job.returncode == 8:
        return "lost worker", delay, took
    if job.returncode != 0 and any(s in err for s in SAID):
        return "start-up", delay, took
    return f"exit {job.returncode}", delay, took


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--window", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    impl = mpiimpl.of_mpirun(mpirun())
    rng = random.Random(a.seed)
    rows = []
    summary = Path(f"/tmp/startup-kills-{os.getpid()}.json")
    for i in range(a.trials):
        rows.append(trial(impl, rng, a.window, summary))
        print(f"[{i + 1}/{a.trials}] kill at {rows[-1][1]:.2f} s -> {rows[-1][0]} ({rows[-1][2]:.1f} s to end)", flush=True)
    kinds = sorted({r[0] for r in rows})
    good = sum(r[0] in ("start-up", "lost worker") for r in rows)
    lines = [f"# Start-up kills, {impl.title} ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"`python benchmarks/startup_kills.py --trials {a.trials} --window {a.window}`; {machine()}.", "",
             "A worker SIGKILLed 0..window s after its process appeared, `mpirun` with the keep-going flag, np 4, "
             "`--worker-timeout 1`, every rank making 60,000 synthetic examples before the setup agreement.", "",
             f"**{good} of {a.trials} as documented** (docs/lost-ranks.md, the start-up row).", "",
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
