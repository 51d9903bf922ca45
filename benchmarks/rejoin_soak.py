"""Rejoin soak: kill a worker, start a joiner in its place, again and again; does the job stay whole?

    python benchmarks/rejoin_soak.py                # ~5 min on 2 cores; writes benchmarks/REJOIN.md
    python benchmarks/rejoin_soak.py --minutes 1    # a quick look

With `--respawn` (MPICH and Open MPI) the job is started with `--respawn CYCLES` and replaces each
killed worker itself (MPI_Comm_spawn, join.py) instead of a joiner started by hand; the report goes
to a section of REJOIN.md naming its MPI. The job is stopped with its MPI's stop signal
(Open MPI's prterun: SIGUSR1, exit 138; but 137 once a spawned worker was killed: prterun reports
that one-rank job's code).

`--join` needs MPICH (join.py). Not part of CI (tests/test_join.py joins once per job
under timeouts). Runs one job after another until --minutes are spent, alternating async and sync:
`mpirun -disable-auto-cleanup -np 3` (1 parameter server + 2 workers) on synthetic data with
--checkpoint-dir. Once training runs, cycle: SIGKILL a random live worker from outside (one the
job started with, or a joiner), wait for rank 0 to go on without it, start the same command with
`--join` under its own mpirun, wait until it has joined; CYCLES times. Then the job is stopped
with SIGTERM to its mpirun, as `scancel` does. A job passes when it stopped as documented (exit
143, every live rank's process gone, the joiners' mpiruns too), its summary lists every kill in
`lost_workers` and every join in `joined_workers`, the workers left end on rank 0's parameters in
sync (identical replicas), and no traceback was printed. Reported: each kill -> going on and
join -> joined time, and rank 0's resident memory and open file descriptors after each join
(a leak of communicators, ports or requests per join would show there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from support import IMPL, Job, dump_stacks, mpiimpl, rank_pids, spawned_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

NP = 3
CYCLES = 4
TIMEOUT_S = 2.0  # --worker-timeout (the soak's own --worker-timeout sets another)
WORKER_TIMEOUT_S = [TIMEOUT_S]  # this run's
STEPS = 10_000_000  # never reached: the job is stopped with SIGTERM after its cycles
MODES = ("async", "sync")
# Rank 0's RSS per join, first to last. Each joined process's UCX shared-memory FIFO (SysV, ~2 MiB)
# stays mapped in rank 0 after that process is gone (MPICH keeps the endpoint of a process it saw;
# measured with /proc/PID/smaps: one 2.1 MiB SYSV mapping more per join; ipcs shows none left after
# the job). A leak of a model's worth of state per join would pass this; one of a FIFO's a phase would not.
GROWTH_PER_JOIN_MIB = 3.0
# --respawn under MPICH: 3.0 MiB per respawn (4, 2 and 3 MiB from one to the next, measured): each
# spawned process is a process group of its own to MPICH. Open MPI: 0.1 MiB.
GROWTH_PER_RESPAWN_MIB = 4.0


def flags(mode: str, ck: str) -> list[str]:
    return ["--mode", mode, "--dataset", "synthetic", "--no-progress", "--steps", str(STEPS), "--worker-timeout",
            str(WORKER_TIMEOUT_S[0]), "--checkpoint-dir", ck, "--straggler", "1:0.002"]


def proc_status(pid: int) -> tuple[float, int]:
    """(resident MiB, open file descriptors) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def one_job(mode: str, rng: random.Random, cycles: int, respawn: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ck, summary_path = str(Path(tmp) / "ck"), Path(tmp) / "s.json"
        how = ["--respawn", str(cycles)] if respawn else []
        cmd = [mpirun(), *IMPL.keep_going, *mpiimpl.local_flags(IMPL, spawns=respawn), "-np", str(NP), sys.executable,
               "-m", "mpitrain", *flags(mode, ck), *how, "--summary-json", str(summary_path)]
        job = Job(cmd, tmp)
        job.wait_for("rank 0 parameter-server", 120)
        time.sleep(2)
        rank0 = job.rank0 = rank_pids(job.proc.pid)[0][0]
        joiners: list[Job] = []  # each joiner's own mpirun
        live = [("job", r) for r in range(1, NP)]  # who to kill: a rank of the job's mpirun, or a joiner's index
        problems, going_on_s, joined_s, status = [], [], [], []
        kills = joins = 0
        spawned_killed = False
        stacks = ""  # every live process's stack, taken when the job stalled (the known MPICH --respawn stall)
        for _ in range(cycles):
            victim = rng.choice(live)
            pid = (rank_pids(job.proc.pid).get(victim[1], (None,))[0] if victim[0] == "job"
                   else victim[1] if victim[0] == "spawned"
                   else rank_pids(joiners[victim[1]].proc.pid).get(0, (None,))[0])
            if pid is None or job.proc.poll() is not None:
                problems.append(f"no process for {victim}, or the job ended")
                break
            seen = len([1 for _, _, ln in job.lines if "regrouped at global step" in ln or "; continuing with" in ln])
            known = set(spawned_pids(job.proc.pid))  # before the kill: the job may spawn within half a second
            t = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            kills += 1
            spawned_killed |= victim[0] == "spawned"
            live.remove(victim)
            if not wait_count(job, ("regrouped at global step", "; continuing with"), seen + 1, 60):
                problems.append("the job did not go on after a kill")
                stacks = stalled(job)
                break
            going_on_s.append(time.monotonic() - t)
            before = len([1 for _, _, ln in job.lines if "joined as rank" in ln])
            t = time.monotonic()
            if not respawn:
                joiners.append(Job([mpirun(), *mpiimpl.local_flags(IMPL), "-np", "1", sys.executable, "-m", "mpitrain",
                                    *flags(mode, ck), "--join"], tmp))
            # Stacks at STALL_S without the join, before rank 0's own deadline (join.py: 30 s) ends the
            # job: taken at 120 s (2026-11-27) they showed only the spawned worker, left in MPI_Init.
            early = "" if wait_count(job, ("joined as rank",), before + 1, STALL_S) else stalled(job)
            if not wait_count(job, ("joined as rank",), before + 1, 120 - STALL_S):
                problems.append("a joiner did not join")
                stacks = f"\n(at {STALL_S:g} s without the join){early}\n(at 120 s){stalled(job)}"
                break
            joins += 1
            joined_s.append(time.monotonic() - t)
            if respawn:
                new_ones = [p for p in spawned_pids(job.proc.pid) if p not in known]
                if len(new_ones) != 1:
                    problems.append(f"{len(new_ones)} new spawned processes after a respawn")
                    break
                live.append(("spawned", new_ones[0]))
            else:
                live.append(("joiner", len(joiners) - 1))
            time.sleep(rng.uniform(1.0, 3.0))
            status.append(proc_status(rank0))
        job.proc.send_signal(getattr(signal, IMPL.stop_signal))  # as scancel does (Open MPI's prterun: SIGUSR1)
        code, leftovers = job.finish(120)
        ends = [j.finish(60) for j in joiners]
        err = job.text("err") + "".join(j.text() for j in joiners)
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        if code is None or any(c is None for c, _ in ends):
            problems.append("hang")
        if "Traceback" in err:
            problems.append("traceback")
        if leftovers or any(left for _, left in ends):
            problems.append("a process outlived its mpirun")
        stopped = 128 + getattr(signal, IMPL.stop_signal)
        if spawned_killed and IMPL is mpiimpl.OPENMPI:  # prterun reports a spawned process's job as its own:
            stopped = 128 + signal.SIGKILL  # that one rank's 137 (measured: 12 of 12 jobs; README, --respawn)
        if code != stopped:
            problems.append(f"exit {code}, not {stopped} (stopped by {IMPL.stop_signal})")
        if summary is None:
            problems.append("no summary")
        else:
            if len(summary["lost_workers"]) != kills:
                problems.append(f"{len(summary['lost_workers'])} lost_workers for {kills} kills")
            if len(summary["joined_workers"]) != joins:
                problems.append(f"{len(summary['joined_workers'])} joined_workers for {joins} joins")
            if mode == "sync" and summary["worker_param_digests"] != [summary["param_digest"]] * summary["workers"]:
                problems.append("replicas differ")
        return {"mode": mode, "kills": kills, "joins": joins, "exit": code, "problems": problems,
                "going_on_s": going_on_s, "joined_s": joined_s, "status": status,
                "steps": summary["global_step"] if summary else None, "err": err[-3000:] + stacks}


STALL_S = 10.0  # a join that has not happened this long after the kill: every process's stack, then


def stalled(job: Job) -> str:
    """The job made no progress: where each of its processes is, spawned ones too."""
    # The job's own rank 0 by the pid it started with: a spawned worker is rank 0 of its own spawn's
    # world too, and took that name in the 2026-11-27 soaks' stacks.
    more = {f"spawned {i}": pid for i, pid in enumerate(spawned_pids(job.proc.pid))}
    if getattr(job, "rank0", None):
        more["the job's rank 0"] = job.rank0
    return "\n" + dump_stacks(job.proc.pid, more)


def wait_count(job: Job, texts: tuple[str, ...], count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([1 for _, _, ln in list(job.lines) if any(t in ln for t in texts)]) >= count:
            return True
        if job.proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cycles", type=int, default=CYCLES, help="kills and joins per job")
    p.add_argument("--worker-timeout", type=float, default=TIMEOUT_S, help="the jobs' --worker-timeout")
    p.add_argument("--respawn", action="store_true", help="the job replaces each killed worker itself (--respawn)")
    p.add_argument("--out", default=None, help="default: benchmarks/REJOIN.md (a section per run)")
    args = p.parse_args()
    WORKER_TIMEOUT_S[0] = args.worker_timeout
    if IMPL is not mpiimpl.MPICH and not args.respawn:
        print("rejoin_soak.py: error: --join needs MPICH; run this from an install with pip install -e '.[mpich]', "
              "or soak --respawn", file=sys.stderr)
        return 2
    name = "REJOIN"
    args.out = args.out or str(ROOT / "benchmarks" / f"{name}.md")
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    t0, jobs = time.monotonic(), []
    while time.monotonic() - t0 < args.minutes * 60:
        mode = MODES[len(jobs) % len(MODES)]
        print(f"[job {len(jobs) + 1}] {mode}", file=sys.stderr, flush=True)
        jobs.append(one_job(mode, rng, args.cycles, args.respawn))
        j = jobs[-1]
        print(f"  {j['kills']} kills, {j['joins']} joins, exit {j['exit']}, {j['problems'] or 'as documented'}",
              file=sys.stderr, flush=True)
    minutes = (time.monotonic() - t0) / 60
    rows = ["| job | mode | kills | joins | kill -> going on (s) | start -> joined (s) | rank 0 after each join: RSS MiB / fds | global step | exit | outcome |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    growth_ok = True
    for i, j in enumerate(jobs, 1):
        rss = [r for r, _ in j["status"]]
        fds = [f for _, f in j["status"]]
        if len(rss) > 1:
            j["per_join_mib"] = (rss[-1] - rss[0]) / (len(rss) - 1)
            growth_ok &= j["per_join_mib"] <= (GROWTH_PER_RESPAWN_MIB if args.respawn else GROWTH_PER_JOIN_MIB)
        # Fewer new descriptors than joins: a leak per join shows as one more each time (Open MPI opened
        # one more once in some jobs, at the first to third respawn, and no more after: measured).
        growth_ok &= not fds or fds[-1] - fds[0] < max(1, len(fds) - 1)
        rows.append(f"| {i} | {j['mode']} | {j['kills']} | {j['joins']} | {', '.join(f'{x:.1f}' for x in j['going_on_s'])} "
                    f"| {', '.join(f'{x:.1f}' for x in j['joined_s'])} | "
                    f"{', '.join(f'{r:.0f}/{f}' for r, f in j['status'])} | {j['steps']} | {j['exit']} | "
                    f"{'; '.join(j['problems']) or 'documented'} |")
    ok = sum(not j["problems"] for j in jobs)
    joined = [x for j in jobs for x in j["joined_s"]]
    per_join = [j["per_join_mib"] for j in jobs if "per_join_mib" in j]
    verdict = "PASS" if ok == len(jobs) and growth_ok else "FAIL"
    text = "\n".join([
        f"# Rejoin soak ({IMPL.title}{', --respawn' if args.respawn else ''})", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine()}",
        f"- command: `{' '.join(['python benchmarks/rejoin_soak.py', *sys.argv[1:]])}` (seed {seed})",
        f"- each job: `mpirun {' '.join(IMPL.keep_going)} -np {NP}` on synthetic data, --worker-timeout {WORKER_TIMEOUT_S[0]:g}, "
        f"rank 1 slowed 2 ms a step; {args.cycles} times: a random live worker SIGKILLed from outside, then "
        + ("the job started a worker in its place itself (`--respawn`)" if args.respawn else
           "`mpirun -np 1 ... --join` started once the job went on without it")
        + f"; then {IMPL.stop_signal} to the job's mpirun", "",
        *rows, "",
        f"{len(jobs)} jobs in {minutes:.1f} min, {sum(j['kills'] for j in jobs)} kills and "
        f"{sum(j['joins'] for j in jobs)} joins, {ok} of {len(jobs)} jobs as documented; a joiner's start to joined "
        f"median {statistics.median(joined) if joined else float('nan'):.1f} s; rank 0's RSS grew a median "
        f"{statistics.median(per_join) if per_join else float('nan'):.1f} MiB per join (at most "
        f"{GROWTH_PER_RESPAWN_MIB if args.respawn else GROWTH_PER_JOIN_MIB:g}) and fewer new file descriptors "
        f"than joins from the first join to the last: "
        f"{'yes' if growth_ok else 'no'}.", "",
        f"Verdict: **{verdict}**", "",
    ])
    for i, j in enumerate(jobs, 1):
        if j["problems"]:
            text += f"\nJob {i} ({'; '.join(j['problems'])}), the end of its stderr:\n\n```text\n{j['err']}\n```\n"
    record(args.out, text)
    print(text)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
