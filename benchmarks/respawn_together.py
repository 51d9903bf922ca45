"""--respawn when a host fails: two workers SIGKILLed together at a random moment. Is each replaced, or
does a line say why not, and does every such job end as documented?

    python benchmarks/respawn_together.py                 # ~8 min on 2 cores; writes a section of RESPAWN.md
    python benchmarks/respawn_together.py --trials 2      # a quick look

Runs under the MPI of this install's mpirun (the section names it).
Each trial: `mpirun KEEP-GOING -np 5 python -m mpitrain --mode MODE --dataset synthetic --respawn 2
--worker-timeout 3 ...` (1 server + 4 workers) with a short budget, so that some kills land before
the replacements can join and some at the budget's end; once rank 0 has announced the ranks, two
random workers are SIGKILLed together after a uniformly random wait. A trial passes when the job ends
with the documented exit code (8; hydra: 137; or 0 if the kills came after the budget), finishes its
budget, prints no traceback and leaves no process, and every lost worker was replaced or a line of
rank 0's says why not ("no worker was started in place of ...", "... did not join: ...").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import sys
import tempfile
from pathlib import Path

from support import IMPL, ExitCode, Job, end_problems, mpiimpl, rank_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

# Budgets short enough that a random kill often lands near the end (2 cores: async ~3 s, sync ~3 s).
BUDGET = {"async": 3000, "sync": 500}
SPAN_S = {"async": 2.5, "sync": 3.0}  # the kills come 0.2 s to this long after the ranks are announced
NP = 5
UNREPLACED = re.compile(r"no worker was started in place of (?:the lost one|any of the (\d+) lost)|did not join: ")


def trial(mode: str, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpirun(), *IMPL.keep_going, *mpiimpl.local_flags(IMPL, True), "-np", str(NP), sys.executable, "-m",
               "mpitrain", "--mode", mode, "--dataset", "synthetic", "--steps", str(BUDGET[mode]), "--respawn", "2",
               "--no-progress", "--worker-timeout", "3", "--checkpoint-dir", f"{tmp}/ck", "--summary-json", f"{tmp}/s.json"]
        job = Job(cmd, tmp)
        if job.wait_for(f"rank {NP - 1} worker", 60) is None:
            job.finish(10)
            return {"mode": mode, "lost": 0, "replaced": 0, "said": 0, "problems": ["the job never started"],
                    "text": job.text()[-800:]}
        wait = rng.uniform(0.2, SPAN_S[mode])
        job.wait_for("never printed", wait)  # sleeps `wait` while reading the output
        victims = rng.sample(range(1, NP), 2)
        pids = rank_pids(job.proc.pid)
        for r in victims:
            try:
                os.kill(pids[r][0], signal.SIGKILL)
            except (KeyError, ProcessLookupError):
                pass
        code, leftovers = job.finish(180)
        text = job.text()
        summary = json.loads(Path(f"{tmp}/s.json").read_text()) if Path(f"{tmp}/s.json").exists() else None
    problems = end_problems(code, leftovers, text, summary)
    lost = replaced = said = 0
    if summary is not None:
        lost = len(summary["lost_workers"])
        replaced = sum(1 for j in summary["joined_workers"] if j.get("respawned"))
        said = sum(int(m.group(1) or 1) for m in UNREPLACED.finditer(text))
        if summary["global_step"] != BUDGET[mode]:
            problems.append(f"global step {summary['global_step']} of {BUDGET[mode]}")
        if replaced + said < lost:
            problems.append(f"{lost} lost, {replaced} replaced, {said} said why not")
        # Nothing lost: the kills came after the budget, to processes on their way out (hydra then reports
        # a killed one's 137) or already gone (0).
        if code not in ((ExitCode.WORKER_LOST,) if lost else (0, ExitCode.WORKER_LOST)):
            problems.append(f"exit {code}")
    return {"mode": mode, "wait_s": round(wait, 2), "victims": victims, "lost": lost, "replaced": replaced,
            "said": said, "code": code, "problems": problems, "text": text[-1500:] if problems else ""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12, help="per mode")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "RESPAWN.md"))
    args = p.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    for mode in args.modes.split(","):
        for i in range(args.trials):
            r = trial(mode, args.seed * 1000 + len(results))
            results.append(r)
            print(f"[{mode} {i + 1}/{args.trials}] kill {r.get('victims')} at {r.get('wait_s')} s: lost {r['lost']}, "
                  f"replaced {r['replaced']}, said {r['said']}, exit {r.get('code')} {'; '.join(r['problems']) or 'ok'}",
                  file=sys.stderr, flush=True)
    lines = ["# --respawn: two workers SIGKILLed together", "",
             f"`python benchmarks/respawn_together.py --trials {args.trials}`, {started:%Y-%m-%d %H:%M} UTC, on "
             f"{machine()}, under {IMPL.name}. See the script's docstring for what a trial is and when it passes.", "",
             "| mode | trials | as documented | both replaced | one replaced, one line | none replaced, a line for both | killed after the budget |",
             "|---|---|---|---|---|---|---|"]
    for mode in args.modes.split(","):
        rs = [r for r in results if r["mode"] == mode]
        ok = sum(not r["problems"] for r in rs)
        lines.append(f"| {mode} | {len(rs)} | {ok} | {sum(r['lost'] == 2 and r['replaced'] == 2 for r in rs)} | "
                     f"{sum(r['lost'] == 2 and r['replaced'] == 1 for r in rs)} | "
                     f"{sum(r['lost'] == 2 and r['replaced'] == 0 for r in rs)} | {sum(r['lost'] == 0 for r in rs)} |")
    bad = [r for r in results if r["problems"]]
    lines += ["", f"**{len(results) - len(bad)} of {len(results)} trials ended as documented.**"]
    for r in bad:
        lines += ["", f"- {r['mode']}, workers {r.get('victims')} killed {r.get('wait_s')} s in: {'; '.join(r['problems'])}",
                  "", "  ```text", *[f"  {x}" for x in r["text"].splitlines()[-20:]], "  ```"]
    record(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
