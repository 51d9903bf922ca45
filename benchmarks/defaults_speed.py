"""What async's worker-count defaults cost in speed (issue 48's speed goal: at most 10% at np=3).

    python benchmarks/defaults_speed.py [--reps 5] [--steps 3000] [--sizes 2 4 8]

Async's defaults decide two things from the worker count (config.AUTO_OVERLAP_MAX_WORKERS,
DEFAULT_STALENESS_TOLERANCE): overlap up to 2 workers (4 before 2026-11-29), and a gradient more than 8 updates stale
steps at lr x 8 / staleness. Before them async always overlapped and never damped
(`--overlap --staleness-lr 0`). At each size this runs both, alternating, on synthetic MNIST-shaped
data (MLP, the same steps), and reports the medians of samples/s and their ratio: this VM is noisy,
read the ratio. Above 2 workers the defaults stop overlapping on purpose (the accuracy they buy is in
QUALITY_SCALE*.md), so there the ratio is the price of that accuracy, not overhead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from run import machine, run_mpitrain, synthetic  # same folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parent.parent
OLD = ["--overlap", "--staleness-lr", "0"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="worker counts (np = workers + 1)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "AB.md"))
    args = p.parse_args()
    started = time.time()
    lines = ["# Async's worker-count defaults against the old ones: speed", "",
             f"`python benchmarks/defaults_speed.py --reps {args.reps} --steps {args.steps} --sizes "
             f"{' '.join(map(str, args.sizes))}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}. "
             f"MLP 784-100-10, synthetic, {args.steps} global steps, async; old = `{' '.join(OLD)}`; "
             f"the two alternate, median of {args.reps} (samples/s, lowest-highest).", "",
             "| workers (np) | defaults | old defaults | defaults / old | staleness mean / p99, defaults vs old |",
             "|---|---|---|---|---|"]
    for workers in args.sizes:
        runs = {"new": [], "old": []}
        for _ in range(args.reps):
            runs["new"].append(run_mpitrain(workers + 1, synthetic("mlp", args.steps)))
            runs["old"].append(run_mpitrain(workers + 1, [*synthetic("mlp", args.steps), *OLD]))
        rate = {k: [r["samples_per_second"] for r in v] for k, v in runs.items()}
        stale = {k: (statistics.median((r.get("staleness") or {}).get("mean") or 0 for r in v),
                     statistics.median((r.get("staleness") or {}).get("p99") or 0 for r in v)) for k, v in runs.items()}
        new, old = statistics.median(rate["new"]), statistics.median(rate["old"])
        lines.append(f"| {workers} ({workers + 1}) | {new:,.0f} ({min(rate['new']):,.0f}-{max(rate['new']):,.0f}) | "
                     f"{old:,.0f} ({min(rate['old']):,.0f}-{max(rate['old']):,.0f}) | **{new / old:.2f}x** | "
                     f"{stale['new'][0]:.1f} / {stale['new'][1]:g} vs {stale['old'][0]:.1f} / {stale['old'][1]:g} |")
        print(lines[-1], flush=True)
    lines += ["", f"{(time.time() - started) / 60:.0f} min."]
    record(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
