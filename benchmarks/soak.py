"""Soak: async np=4 for about 10 minutes with a straggler; does anything grow or leak?

    python benchmarks/soak.py                 # ~10.5 min on 2 cores; writes benchmarks/SOAK.md
    python benchmarks/soak.py --minutes 1     # a quick look

Not part of CI. A 20 s calibration run measures the step rate, then one run is given the
number of global steps that fill --minutes. Reported: global steps done, each rank's peak RSS
when training started and when it ended (growth must stay within 10%), and requests left open
at exit, as MPICH itself reports them at MPI_Finalize ("Builtin communicator ... has pending N
references": every request still open holds a reference); the soak fails if it finds any.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import env, machine, mpirun  # same folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parent.parent
MAX_RSS_GROWTH = 0.10
LEAK = re.compile(r"MPICH: .*has pending (\d+) references")
ARGS = ["--mode", "async", "--dataset", "synthetic", "--straggler", "3:x3",
        "--checkpoint-every-secs", "60"]


def run(np_: int, steps: int, tmp: str, name: str) -> tuple[dict, str, float]:
    summary = os.path.join(tmp, f"{name}.json")
    cmd = [mpirun(), "-np", str(np_), sys.executable, "-m", "mpitrain", *ARGS, "--no-progress", "--steps", str(steps),
           "--checkpoint-dir", os.path.join(tmp, f"ck-{name}"), "--summary-json", summary]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"mpitrain failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(Path(summary).read_text()), proc.stdout + proc.stderr, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "SOAK.md"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        calib, _, _ = run(a.np, 4000, tmp, "calibration")
        steps = int(calib["steps_per_second"] * a.minutes * 60)
        print(f"calibration: {calib['steps_per_second']:.0f} global steps/s -> {steps} steps for {a.minutes} min",
              flush=True)
        s, output, seconds = run(a.np, steps, tmp, "soak")
    leaks = [int(n) for n in LEAK.findall(output)]
    rows, failures = [], []
    for m in s["max_rss_mb"]:
        growth = m["end"] / m["start"] - 1
        rows.append(f"| {m['rank']} | {m['start']:.1f} | {m['end']:.1f} | {growth:+.1%} |")
        if growth > MAX_RSS_GROWTH:
            failures.append(f"rank {m['rank']} peak RSS grew {growth:.1%}")
    if leaks:
        failures.append(f"MPICH reported {sum(leaks)} open request reference(s) at exit")
    if s["lost_workers"]:
        failures.append(f"workers lost: {s['lost_workers']}")
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    lines = [
        "# Soak results", "",
        f"`python benchmarks/soak.py --minutes {a.minutes:g} --np {a.np}` on {machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}.", "",
        f"mpitrain {' '.join(ARGS)}: {s['global_step']:,} global steps in {s['wall_seconds']:.0f} s of training "
        f"({seconds:.0f} s in all), worker steps {s['worker_steps']}, {s['samples_per_second']:,.0f} samples/s, "
        f"test accuracy {s['test_accuracy']:.4f}, staleness mean {s['staleness']['mean']:.2f} max "
        f"{s['staleness']['max']}, {len(s['checkpoints'])} checkpoints written.", "",
        "| rank | peak RSS at start (MiB) | peak RSS at end (MiB) | growth |", "|---|---|---|---|", *rows, "",
        f"Open requests at exit (MPICH's count at MPI_Finalize): {sum(leaks)}.", "",
        f"Verdict (RSS growth <= {MAX_RSS_GROWTH:.0%}, no open requests, no lost worker): **{verdict}**", "",
    ]
    record(a.out, "\n".join(lines))
    print("\n".join(lines))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
