"""What one slow worker costs each mode, and what --quorum and --max-staleness buy back.

    python benchmarks/stragglers.py            # ~5 min on 2 cores; writes benchmarks/STRAGGLERS.md

np=4 (1 parameter server + 3 workers), and np=3 (2 workers: issue #33's TF backup-worker case),
MLP 784-100-10, batch 100, synthetic data; the straggler is the last rank with every step taking
5x as long (--straggler 3:x5 at np=4). Each configuration runs with and
without the straggler, interleaved, median of --reps. Reported: global steps/s, the ratio to the
same configuration without straggler, and the time until rank 0's parameters first reach
--target test accuracy (evaluated every --eval-every global steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from run import machine, run_mpitrain  # same folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [  # (name, ranks, flags); the straggler is the last rank
    ("sync, no quorum", 4, ["--mode", "sync"]),
    ("sync --quorum 2", 4, ["--mode", "sync", "--quorum", "2"]),
    ("async", 4, ["--mode", "async"]),
    ("async --max-staleness 2", 4, ["--mode", "async", "--max-staleness", "2"]),
    # issue #33's anchor: TF's backup workers, replicas_to_aggregate=1 of 2
    ("np=3 sync, no quorum", 3, ["--mode", "sync"]),
    ("np=3 sync --quorum 1", 3, ["--mode", "sync", "--quorum", "1"]),
]


def straggler(np_: int) -> list[str]:
    return ["--straggler", f"{np_ - 1}:x5"]


QUORUM, Q1, SYNC3 = "sync --quorum 2", "np=3 sync --quorum 1", "np=3 sync, no quorum"


def time_to(summary: dict, target: float) -> float | None:
    for e in summary["eval_history"]:
        if e["test_accuracy"] >= target:
            return e["seconds"]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--lr", type=float, default=0.005, help="low enough that reaching --target takes a few hundred steps")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "STRAGGLERS.md"))
    args = p.parse_args()
    # --eval-at-end: the evaluations' copies are scored after training, so a time to the target is training's alone
    base = ["--dataset", "synthetic", "--model", "mlp", "--steps", str(args.steps), "--eval-every", str(args.eval_every),
            "--eval-at-end", "--lr", str(args.lr)]
    raw: dict = {}
    for rep in range(args.reps):
        for name, np_, flags in CONFIGS:
            for slow in (False, True):
                print(f"[rep {rep + 1}/{args.reps}] {name} {'with' if slow else 'without'} straggler",
                      file=sys.stderr, flush=True)
                s = run_mpitrain(np_, [*base, *flags, *(straggler(np_) if slow else [])])
                raw.setdefault((name, slow), []).append(s)
    lines = ["| mode | steps/s, no straggler | steps/s, the last rank at 5x | kept | time to "
             f"{args.target:.0%}, no straggler | with straggler | dropped gradients | staleness max / mean |",
             "|---|---|---|---|---|---|---|---|"]
    kept, rate, shares = {}, {}, {}
    for name, _, _ in CONFIGS:
        fast, slow = raw[(name, False)], raw[(name, True)]
        r_fast = statistics.median(s["steps_per_second"] for s in fast)
        r_slow = statistics.median(s["steps_per_second"] for s in slow)
        kept[name] = r_slow / r_fast
        rate[name] = (r_fast, r_slow)
        counted = sorted(fast, key=lambda s: s["steps_per_second"])[len(fast) // 2]["worker_steps"]
        shares[name] = (counted, max(counted) / max(min(counted), 1))

        def tta(runs):
            times = [time_to(s, args.target) for s in runs]
            got = [t for t in times if t is not None]
            return f"{statistics.median(got):.2f} s" if len(got) == len(times) else f"not reached in {len(times) - len(got)}/{len(times)}"

        mid = sorted(slow, key=lambda s: s["steps_per_second"])[len(slow) // 2]
        st = mid["staleness"]
        lines.append(f"| {name} | {r_fast:,.0f} | {r_slow:,.0f} | {kept[name]:.2f}x | {tta(fast)} | {tta(slow)} "
                     f"| {mid['dropped_gradients']} {mid['dropped_gradients_per_worker']} | {st['max']} / {st['mean']:.1f} |")
    checks = [
        ("sync --quorum 2 keeps >= 75% of its step rate", kept["sync --quorum 2"] >= 0.75, kept["sync --quorum 2"]),
        ("sync without quorum falls to about 1/5", kept["sync, no quorum"] <= 0.35, kept["sync, no quorum"]),
        ("async keeps >= 75%", kept["async"] >= 0.75, kept["async"]),
        # issue #33: the quorum uses every worker and keeps its speed
        ("sync --quorum 2 with the straggler: >= 3.5x plain sync's steps/s with it",
         rate["sync --quorum 2"][1] / rate["sync, no quorum"][1] >= 3.5, rate["sync --quorum 2"][1] / rate["sync, no quorum"][1]),
        ("sync --quorum 2 without a straggler: >= 0.90x plain sync's steps/s",
         rate["sync --quorum 2"][0] / rate["sync, no quorum"][0] >= 0.90, rate["sync --quorum 2"][0] / rate["sync, no quorum"][0]),
        ("sync --quorum 2 without a straggler: every worker's gradients counted within 2x of the others' "
         f"({shares[QUORUM][0]})", shares[QUORUM][1] <= 2.0, shares[QUORUM][1]),
        ("np=3 --quorum 1 with the straggler: >= 3.5x plain sync's steps/s with it",
         rate[Q1][1] / rate[SYNC3][1] >= 3.5, rate[Q1][1] / rate[SYNC3][1]),
        ("np=3 --quorum 1 without a straggler: >= 0.90x plain sync's steps/s",
         rate[Q1][0] / rate[SYNC3][0] >= 0.90, rate[Q1][0] / rate[SYNC3][0]),
        ("np=3 --quorum 1 without a straggler: both workers' gradients counted within 2x "
         f"({shares[Q1][0]})", shares[Q1][1] <= 2.0, shares[Q1][1]),
    ]
    text = "\n".join([
        "# Stragglers: one worker at 5x its step time", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine()}",
        f"- command: `{' '.join(['python benchmarks/stragglers.py', *sys.argv[1:]])}`",
        f"- np=4 (1 PS + 3 workers on 2 cores: oversubscribed; the np=3 rows 1 PS + 2 workers), MLP 784-100-10, batch 100, synthetic data, "
        f"{args.steps} global steps, SGD lr {args.lr}, median of {args.reps}; *kept* = steps/s with the straggler / "
        "without; time to accuracy counts from the first step", "",
        *lines, "",
        "| expectation | ratio | met? |", "|---|---|---|",
        *[f"| {name} | {value:.2f}x | {'yes' if ok else 'no'} |" for name, ok, value in checks], "",
        "Notes: the straggler sleeps for its extra time, so on 2 oversubscribed cores the other workers get more "
        "CPU while it sleeps; `--max-staleness 2` with 3 workers also disables overlap (see README).", "",
    ])
    record(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
