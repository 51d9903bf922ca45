"""Is a respawned worker as fast as the one it replaces? Steps/s before a kill and after the replacement.

    python benchmarks/after_respawn.py                 # 3 runs per mode, ~3 min on 2 cores
    python benchmarks/after_respawn.py --runs 1 --modes sync
    python benchmarks/after_respawn.py --by respawn,spare   # --respawn against --spares, interleaved
    python benchmarks/after_respawn.py --modes async --kills one,each,one-x4   # do replacements pile up?
    python benchmarks/after_respawn.py --modes async --kills each --link shm,mpi   # the mailbox against MPI's link

Each run: `mpirun KEEP-GOING -np 5 python -m mpitrain --mode MODE --dataset synthetic --model mlp
--hidden 200 --respawn 10 --worker-timeout 3 --checkpoint-dir ...` (1 server + 4 workers); 9 s in,
worker rank 2 is SIGKILLed from outside; the job replaces it (MPI_Comm_spawn) and starts a new phase.
Global steps/s are read from rank 0's events.jsonl (`--log-dir`, a line every 100 steps: the bar's
\r-rewritten line does not come through Open MPI's prterun): from 4 s to the kill, and from 1.5 s to 6.5 s after
the new phase's first line, and the time from the kill to rank 0's "joined" line. With `--by spare`
the replacement is a hot spare instead (`--spares 1`, np 6: the same 4 workers, and one rank that
waits; mpirun without the network transport it needs only to spawn). Under MPICH a spawned process talks over UCX, the network module, while
the job's own ranks share memory, and MPICH polls the network only in a progress pass where shared
memory moved nothing (transport.TESTS_PER_WAKE says what mpitrain does about it); under Open MPI a
spawned process is reached over TCP (open-mpi/ompi#6823). --kills says which workers are killed, one
after another, each once the previous replacement has joined; "after" is measured after the last:
`one` rank 2 (the default), `each` ranks 1 to 4 (every worker is then a spawned one), `one-x4` rank 2
and then its replacement three times (as many replacements as `each`, one spawned worker at the end:
a job that slows down as replacements pile up, not by what they are, shows it here), `one-x20` the same
with twenty (a 10-minute goodput run's worth of kills, one spawned worker at the end). To compare with
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

from support import IMPL, mpiimpl, rank_pids, spawned_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import env, machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


KILL_AT_S = 9.0
# --kills: whom each kill hits, in order (a rank the job started with, or "spawned": the newest replacement)
KILLS = {"one": (2,), "each": (1, 2, 3, 4), "one-x4": (2, "spawned", "spawned", "spawned"),
         "one-x20": (2, *["spawned"] * 19)}


# how the lost worker is replaced: (ranks, mpitrain's flags, whether mpirun needs what a spawn does)
BY = {"respawn": (5, ("--respawn", "10"), True), "spare": (6, ("--spares", "1"), False)}


def one_run(mode: str, by: str = "respawn", kills: str = "one", link: str = "shm") -> tuple[float, float, float]:
    """(steps/s before the first kill, steps/s after the last replacement's phase started, the first
    kill -> joined in s)."""
    ranks, flags, spawns = BY[by]
    if by == "respawn":  # one respawn for each kill at least
        flags = ("--respawn", str(max(10, len(KILLS[kills]))))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpirun(), *mpiimpl.local_flags(IMPL, spawns=spawns), *IMPL.keep_going, "-np", str(ranks), sys.executable,
               "-m", "mpitrain", "--mode", mode, "--dataset", "synthetic", "--model", "mlp", "--hidden", "200", "--steps",
               "100000000", "--worker-timeout", "3", *flags, "--checkpoint-dir", tmp + "/ck", "--no-progress",
               "--log-dir", tmp + "/log", "--log-every", "100", "--joined-link", link]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                                cwd=str(ROOT), start_new_session=True)
        phase, joined, killed = [], [], []

        def read() -> None:
            for line in proc.stdout:
                if "training on from" in line:
                    phase.append(time.time() - t0)
                if "joined as rank" in line:
                    joined.append(time.time() - t0)

        threading.Thread(target=read, daemon=True).start()
        time.sleep(KILL_AT_S)
        try:
            for victim in KILLS[kills]:
                pid = spawned_pids(proc.pid)[-1] if victim == "spawned" else rank_pids(proc.pid)[victim][0]
                os.kill(pid, signal.SIGKILL)
                killed.append(time.time() - t0)
                while len(phase) < len(killed) and time.time() - t0 - killed[-1] < 40:
                    time.sleep(0.1)
                time.sleep(2.0)  # the replacement trains a moment before the next kill
            time.sleep(5)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        points = [(e["time"] - t0, e["global_step"]) for e in map(json.loads, Path(tmp, "log", "events.jsonl").open())
                  if e.get("event") == "train"]
    start = phase[-1] if len(phase) == len(killed) else float("nan")
    first_join = (joined or [float("nan")])[0]
    return rate(points, 4.0, KILL_AT_S), rate(points, start + 1.5, start + 6.5), first_join - killed[0]


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
    p.add_argument("--kills", default="one", help=f"comma-separated, of {', '.join(KILLS)}: run side by side")
    p.add_argument("--link", default="shm", help="comma-separated --joined-link values (shm, mpi): run side by side")
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"`python benchmarks/after_respawn.py --runs {a.runs} --modes {a.modes} --by {a.by} --kills {a.kills} --link {a.link}` at "
          f"{commit} (working "
          f"tree), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}, under {IMPL.title}\n")
    print("| mode | replaced by | kills | --joined-link | steps/s before the kill (runs) | after the replacement (runs) | "
          "after / before (median) | kill -> joined, s (median) |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [(by, k, link) for by in a.by.split(",") for k in a.kills.split(",") for link in a.link.split(",")]
    for mode in a.modes.split(","):
        runs = {case: [] for case in cases}
        for _ in range(a.runs):  # interleaved: this VM's speed drifts
            for by, k, link in cases:
                runs[by, k, link].append(one_run(mode, by, k, link))
        for (by, k, link), got in runs.items():
            ratio = statistics.median(after / before for before, after, _ in got)
            print(f"| {mode} | {by} | {k} | {link} | {', '.join(f'{b:.0f}' for b, _, _ in got)} | "
                  f"{', '.join(f'{x:.0f}' for _, x, _ in got)} | {ratio:.2f}x | "
                  f"{statistics.median(j for _, _, j in got):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
