"""Is a respawned worker as fast as the one it replaces? Steps/s before a kill and after the replacement.

    python benchmarks/after_respawn.py                 # 3 runs per mode, ~3 min on 2 cores
    python benchmarks/after_respawn.py --runs 1 --modes sync

Each run: `mpirun KEEP-GOING -np 5 python -m mpitrain --mode MODE --dataset synthetic --model mlp
--hidden 200 --respawn 10 --worker-timeout 3 --checkpoint-dir ...` (1 server + 4 workers); 9 s in,
worker rank 2 is SIGKILLed from outside; the job replaces it (MPI_Comm_spawn) and starts a new phase.
Global steps/s are read from the progress bar: from 4 s to the kill, and from 1.5 s to 6.5 s after
the new phase's first line. Under MPICH a spawned process talks over UCX, the network module, while
the job's own ranks share memory, and MPICH polls the network only in a progress pass where shared
memory moved nothing (transport.TESTS_PER_WAKE says what mpitrain does about it). To compare with
another commit, run this file from a worktree of it (`git worktree add /tmp/old COMMIT`).
Prints a Markdown table; not part of CI.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from chaos import IMPL  # same folder
from run import env, machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpitrain import mpiimpl  # noqa: E402
from mpitrain.faults import rank_pids  # noqa: E402

KILL_AT_S = 9.0
BAR = re.compile(r"\| (\d+)/100000000")


def one_run(mode: str) -> tuple[float, float]:
    """(steps/s before the kill, steps/s after the replacement's phase started)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpirun(), *mpiimpl.local_flags(IMPL, spawns=True), *IMPL.keep_going, "-np", "5", sys.executable, "-m",
               "mpitrain", "--mode", mode, "--dataset", "synthetic", "--model", "mlp", "--hidden", "200", "--steps",
               "100000000", "--worker-timeout", "3", "--respawn", "10", "--checkpoint-dir", tmp + "/ck", "--progress"]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                                cwd=str(ROOT), start_new_session=True)
        points, phase = [], []

        def read() -> None:
            line = ""
            while ch := proc.stdout.read(1):  # the bar rewrites its line with \r
                line += ch
                if ch in "\r\n":
                    if m := BAR.search(line):
                        points.append((time.monotonic() - t0, int(m.group(1))))
                    if "training on from" in line and not phase:
                        phase.append(time.monotonic() - t0)
                    line = ""

        threading.Thread(target=read, daemon=True).start()
        time.sleep(KILL_AT_S)
        os.kill(rank_pids(proc.pid)[2][0], signal.SIGKILL)
        while not phase and time.monotonic() - t0 < KILL_AT_S + 40:
            time.sleep(0.1)
        time.sleep(7)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    start = phase[0] if phase else float("nan")
    return rate(points, 4.0, KILL_AT_S), rate(points, start + 1.5, start + 6.5)


def rate(points: list, a: float, b: float) -> float:
    inside = [(t, s) for t, s in points if a <= t <= b]
    if len(inside) < 2:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="sync,async")
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"`python benchmarks/after_respawn.py --runs {a.runs}` at {commit} (working tree), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}, under {IMPL.title}\n")
    print("| mode | steps/s before the kill (runs) | after the replacement (runs) | after / before (median) |")
    print("|---|---|---|---|")
    for mode in a.modes.split(","):
        runs = [one_run(mode) for _ in range(a.runs)]
        ratio = statistics.median(after / before for before, after in runs)
        print(f"| {mode} | {', '.join(f'{b:.0f}' for b, _ in runs)} | {', '.join(f'{x:.0f}' for _, x in runs)} "
              f"| {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
