"""--respawn: how long a lost worker takes to be replaced, and does every such job end as documented?

    python benchmarks/respawn.py              # ~4 min on 2 cores; writes benchmarks/RESPAWN.md (MPICH)
    python benchmarks/respawn.py --trials 2   # a quick look

Runs under the MPI of this install's mpirun (a section of RESPAWN.md names it). Not
part of CI (tests/test_respawn.py replaces one worker per mode under timeouts). Each trial: the
job `mpirun KEEP-GOING -np 3 python -m mpitrain --mode MODE --respawn 1 --worker-timeout 5
--checkpoint-dir ...` on digits; 1 s after rank 0 has announced the ranks, worker rank 2 is
SIGKILLed from outside. A trial passes when mpirun's exit code is the documented one for a lost
worker (8; hydra: 137), the summary lists rank 2 in `lost_workers` and one respawned worker in
`joined_workers`, the budget was finished, sync replicas are identical, and nothing but
mpitrain's own lines was printed after training (no traceback, no launcher message, no
"MPI_Finalize still waiting"). Reported: kill -> rank 0's "lost" line, "lost" -> "starting a
worker", -> "joined as rank 2", medians per mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support import IMPL, ExitCode, mpiimpl, rank_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

STEPS = {"async": 40000, "sync": 60000}
EVENTS = (("lost", "lost at global step"), ("start", "starting a worker in place"), ("joined", "joined as rank 2"))
# Lines that are not mpitrain's own and must not appear: a launcher telling of a rank that ended badly.
NOISE = ("Traceback", "MPI_Finalize still waiting", *mpiimpl.BAD_END_LINES)


def trial(mode: str, tmp: str) -> dict:
    cmd = [mpirun(), *mpiimpl.local_flags(IMPL, spawns=True), *IMPL.keep_going, "-np", "3", sys.executable, "-m",
           "mpitrain", "--mode", mode, "--steps", str(STEPS[mode]), "--no-progress", "--worker-timeout", "5",
           "--checkpoint-dir", "ck", "--respawn", "1", "--summary-json", "s.json"]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    t0, at, lines, killed = time.monotonic(), {}, [], False
    for line in proc.stdout:
        lines.append(line)
        now = time.monotonic() - t0
        if "rank 2 worker" in line and not killed:
            time.sleep(1)
            os.kill(rank_pids(proc.pid)[2][0], signal.SIGKILL)
            at["kill"], killed = time.monotonic() - t0, True
        for key, words in EVENTS:
            if words in line and key not in at:
                at[key] = now
    proc.wait()
    summary_path = Path(tmp) / "s.json"
    s = json.loads(summary_path.read_text()) if summary_path.exists() else None
    problems = []
    if proc.returncode != ExitCode.WORKER_LOST:
        problems.append(f"exit {proc.returncode}")
    if s is None:
        problems.append("no summary")
    else:
        if [w["rank"] for w in s["lost_workers"]] != [2]:
            problems.append(f"lost_workers {s['lost_workers']}")
        if [j.get("respawned") for j in s["joined_workers"]] != [True]:
            problems.append(f"joined_workers {s['joined_workers']}")
        if s["global_step"] != STEPS[mode]:
            problems.append(f"global step {s['global_step']}")
        if mode == "sync" and s["worker_param_digests"] != [s["param_digest"]] * 2:
            problems.append("replicas differ")
    noise = [ln.strip() for ln in lines if any(n in ln for n in NOISE)]
    if noise:
        problems.append(f"printed: {noise[0][:120]}")
    return {"mode": mode, "at": at, "problems": problems, "tail": "".join(lines[-15:])}


def median_of(trials: list[dict], a: str, b: str) -> str:
    gaps = [t["at"][b] - t["at"][a] for t in trials if a in t["at"] and b in t["at"]]
    return f"{statistics.median(gaps):.2f}" if gaps else "-"


def report(trials: list[dict], seconds: float) -> str:
    ok = sum(not t["problems"] for t in trials)
    out = [f"# --respawn under {IMPL.title}: {ok} of {len(trials)} trials as documented", "",
           f"Measured {datetime.date.today().isoformat()} with `python benchmarks/respawn.py` "
           f"({seconds / 60:.1f} min) on {machine()}.", "",
           "Each trial: `mpirun " + " ".join(IMPL.keep_going) + " -np 3 python -m mpitrain --mode MODE --respawn 1 "
           "--worker-timeout 5 --checkpoint-dir ...` (digits); worker rank 2 SIGKILLed from outside 1 s into "
           "training. Times in seconds, medians.", "",
           "| mode | trials | as documented | kill -> lost | lost -> starting | starting -> joined | lost -> joined |",
           "|---|---|---|---|---|---|---|"]
    for mode in STEPS:
        ts = [t for t in trials if t["mode"] == mode]
        if ts:
            out.append(f"| {mode} | {len(ts)} | {sum(not t['problems'] for t in ts)} | {median_of(ts, 'kill', 'lost')} | "
                       f"{median_of(ts, 'lost', 'start')} | {median_of(ts, 'start', 'joined')} | "
                       f"{median_of(ts, 'lost', 'joined')} |")
    bad = [t for t in trials if t["problems"]]
    if bad:
        out += ["", "Trials not as documented:", ""]
        out += [f"- {t['mode']}: {'; '.join(t['problems'])}" for t in bad]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=6, help="per mode")
    p.add_argument("--out", default=None, help="default: benchmarks/RESPAWN.md (a section per run)")
    a = p.parse_args()
    out = a.out or str(ROOT / "benchmarks" / "RESPAWN.md")
    trials, t0 = [], time.monotonic()
    for n in range(a.trials):
        for mode in STEPS:
            with tempfile.TemporaryDirectory(prefix="mpitrain-respawn-") as tmp:
                t = trial(mode, tmp)
            trials.append(t)
            print(f"{mode} {n}: {'; '.join(t['problems']) or 'as documented'} "
                  f"{ {k: round(v, 2) for k, v in t['at'].items()} }", flush=True)
            if t["problems"]:
                print(t["tail"], flush=True)
    text = report(trials, time.monotonic() - t0)
    record(out, text)
    print(text)
    return 0 if all(not t["problems"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
