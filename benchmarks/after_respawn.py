"""Is a respawned worker as fast as the one it replaces? Steps/s before a kill and after the replacement.

    python benchmarks/after_respawn.py                 # 3 runs per mode, ~3 min on 2 cores
    python benchmarks/after_respawn.py --runs 1 --modes sync
    python benchmarks/after_respawn.py --by respawn,spare   # --respawn against --spares, interleaved

Each run: `mpirun KEEP-GOING -np 5 python -m mpitrain --mode MODE --dataset synthetic --model mlp
--hidden 200 --respawn 10 --worker-timeout 3 --checkpoint-dir ...` (1 server + 4 workers); 9 s in,
worker rank 2 is SIGKILLed from outside; the job replaces it (MPI_Comm_spawn) and starts a new phase.
Global steps/s are read from rank 0's events.jsonl (`--log-dir`, a line every 100 steps: the bar's
\r-rewritten line does not come through Open MPI's prterun): from 4 s to the kill, and from 1.5 s to 6.5 s after
the new phase's first line, and the time from the kill to rank 0's "joined" line. With `--by spare`
the replacement is a hot spare instead (`--spares 1`, np 6: the same 4 workers, and one rank that
waits; mpirun without the network transport it needs only to spawn). Under MPICH a spawned process talks over UCX, the network module, while
the job's own ranks share memory, and MPICH polls the network only in a progress pass where shared
memory moved nothing (transport.TESTS_PER_WAKE says what mpitrain does about it). To compare with
another commit, run this file from a worktree of it (`git worktree add /tmp/old COMMIT`).
Prints a Markdown table; not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
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


# how the lost worker is replaced: (ranks, mpitrain's flags, whether mpirun needs what a spawn does)
BY = {"respawn": (5, ("--respawn", "10"), True), "spare": (6, ("--spares", "1"), False)}


def one_run(mode: str, by: str = "respawn") -> tuple[float, float, float]:
    """(steps/s before the kill, steps/s after the replacement's phase started, kill -> joined in s)."""
    ranks, flags, spawns = BY[by]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpirun(), *mpiimpl.local_flags(IMPL, spawns=spawns), *IMPL.keep_going, "-np", str(ranks), sys.executable,
               "-m", "mpitrain", "--mode", mode, "--dataset", "synthetic", "--model", "mlp", "--hidden", "200", "--steps",
               "100000000", "--worker-timeout", "3", *flags, "--checkpoint-dir", tmp + "/ck", "--no-progress",
               "--log-dir", tmp + "/log", "--log-every", "100"]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                                cwd=str(ROOT), start_new_session=True)
        phase, joined = [], []

        def read() -> None:
            for line in proc.stdout:
                if "training on from" in line and not phase:
                    phase.append(time.time() - t0)
                if "joined as rank" in line and not joined:
                    joined.append(time.time() - t0)

        threading.Thread(target=read, daemon=True).start()
        time.sleep(KILL_AT_S)
        os.kill(rank_pids(proc.pid)[2][0], signal.SIGKILL)
        killed = time.time() - t0
        while not phase and time.time() - t0 < KILL_AT_S + 40:
            time.sleep(0.1)
        time.sleep(7)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        points = [(e["time"] - t0, e["global_step"]) for e in map(json.loads, Path(tmp, "log", "events.jsonl").open())
                  if e.get("event") == "train"]
    start = phase[0] if phase else float("nan")
    return rate(points, 4.0, KILL_AT_S), rate(points, start + 1.5, start + 6.5), (joined or [float("nan")])[0] - killed


def rate(points: list, a: float, b: float) -> float:
    inside = [(t, s) for t, s in points if a <= t <= b]
    if len(inside) < 2:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--by", default="respawn", help=f"comma-separated, of {', '.join(BY)}: run side by side")
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"`python benchmarks/after_respawn.py --runs {a.runs} --modes {a.modes} --by {a.by}` at {commit} (working "
          f"tree), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}, under {IMPL.title}\n")
    print("| mode | replaced by | steps/s before the kill (runs) | after the replacement (runs) | after / before (median) "
          "| kill -> joined, s (median) |")
    print("|---|---|---|---|---|---|")
    bys = a.by.split(",")
    for mode in a.modes.split(","):
        runs = {by: [] for by in bys}
        for _ in range(a.runs):  # interleaved: this VM's speed drifts
            for by in bys:
                runs[by].append(one_run(mode, by))
        for by, got in runs.items():
            ratio = statistics.median(after / before for before, after, _ in got)
            print(f"| {mode} | {by} | {', '.join(f'{b:.0f}' for b, _, _ in got)} | {', '.join(f'{x:.0f}' for _, x, _ in got)} "
                  f"| {ratio:.2f}x | {statistics.median(j for _, _, j in got):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
