"""--ps-transport shm against the message path, side by side in one run (issue: rank 0 off the hot path).

    python benchmarks/shm.py                    # writes benchmarks/SHM.md (~8 min on 2 cores)
    python benchmarks/shm.py --reps 1 --steps 1000 --out /tmp/SHM.md   # a smoke run
    python benchmarks/shm.py --data-dir DIR     # learning on an MNIST-sized set too (the four IDX .gz files)
    python benchmarks/shm.py --models mlp --seeds 0 --reps 7   # throughput only

Throughput: the compute limit (two independent processes, no communication), async np=3 with
`--ps-transport mpi` (the default) and with `shm`, interleaved, each row a median of --reps; rank 0's
busy fraction is CPU / wall over training. Learning: test accuracy and the staleness distribution
of both transports on digits and on synthetic data (async has no digest to compare).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import machine, median_row, run_independent, run_mpitrain, synthetic  # noqa: E402

TRANSPORTS = ("mpi", "shm")
LEARNING = {"digits": ["--dataset", "digits", "--epochs", "50"],
            "synthetic": ["--dataset", "synthetic", "--synthetic-samples", "20000", "--epochs", "5"]}


def throughput(models: list[str], steps: int, reps: int) -> dict:
    rows = {m: {"limit": [], "mpi": [], "shm": []} for m in models}
    for _ in range(reps):  # interleaved: a noisy minute hurts every row alike
        for m in models:
            base = synthetic(m, steps)
            rows[m]["limit"].append(run_independent(2, base))
            for t in TRANSPORTS:
                rows[m][t].append(run_mpitrain(3, [*base, "--mode", "async", "--ps-transport", t]))
    return {m: {k: median_row(v) for k, v in r.items()} for m, r in rows.items()}


def learning(seeds: int, data_dir: str | None) -> dict:
    """--seeds 0: none (a throughput-only run)."""
    out = {}
    if seeds < 1:
        return out
    sets = {**({"mnist-sized": ["--dataset", "mnist", "--data-dir", data_dir]} if data_dir else {}), **LEARNING}
    for name, flags in sets.items():
        for t in TRANSPORTS:
            runs = [run_mpitrain(3, [*flags, "--mode", "async", "--ps-transport", t, "--seed", str(s)])
                    for s in range(seeds)]
            out[(name, t)] = {"acc": [r["test_accuracy"] for r in runs],
                              "p50": statistics.median(r["staleness"]["p50"] for r in runs),
                              "p99": statistics.median(r["staleness"]["p99"] for r in runs),
                              "mean": statistics.median(r["staleness"]["mean"] for r in runs)}
    return out


def report(thr: dict, learn: dict, args) -> list[str]:
    lines = ["# --ps-transport shm vs mpi", "", f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- machine: {machine()}", f"- command: `python benchmarks/shm.py --reps {args.reps} --steps {args.steps} --seeds {args.seeds}"
             f"{' --data-dir DIR' if args.data_dir else ''}`",
             *([f"- mnist-sized: {args.data_source}"] if args.data_source else []),
             "- async, np=3 (rank 0 + 2 workers) on 2 cores: oversubscribed, so rank 0's CPU is taken from the workers",
             "", "## Throughput (synthetic MNIST-shaped data, batch 100, SGD)", "",
             "| model | run | samples/s (median) | min-max | vs compute limit | rank 0 busy |", "|---|---|---|---|---|---|"]
    for m, r in thr.items():
        limit = r["limit"]["rate"]
        for key, name in (("limit", "2 independent processes"), ("mpi", "async --ps-transport mpi"),
                          ("shm", "async --ps-transport shm")):
            row = r[key]
            busy = f"{row['busy']:.0%}" if "busy" in row else ""
            lines.append(f"| {m} | {name} | {row['rate']:,.0f} | {row['min']:,.0f}-{row['max']:,.0f} | "
                         f"{row['rate'] / limit:.2f}x | {busy} |")
        lines.append(f"| {m} | shm / mpi | {r['shm']['rate'] / r['mpi']['rate']:.2f}x | | | |")
    if not learn:
        return lines
    lines += ["", f"## Learning (async np=3, MLP, seeds 0-{args.seeds - 1})", "",
              "| data | transport | test accuracy per seed | median | staleness p50 / p99 / mean |", "|---|---|---|---|---|"]
    for (name, t), r in learn.items():
        accs = " / ".join(f"{a:.4f}" for a in r["acc"])
        lines.append(f"| {name} | {t} | {accs} | {statistics.median(r['acc']):.4f} | "
                     f"{r['p50']:g} / {r['p99']:g} / {r['mean']:.2f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--models", default="mlp,softmax")
    p.add_argument("--data-dir", help="the four MNIST-sized IDX .gz files (left out: digits and synthetic only)")
    p.add_argument("--data-source", default="", help="where those files came from, for the report")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "SHM.md"))
    args = p.parse_args()
    thr = throughput(args.models.split(","), args.steps, args.reps)
    learn = learning(args.seeds, args.data_dir)
    text = "\n".join(report(thr, learn, args)) + "\n"
    record(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
