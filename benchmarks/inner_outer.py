"""Which outer momentum over which inner optimizer (--local-steps H): the default of --outer-momentum.

    python benchmarks/inner_outer.py --data-dir DIR   # ~12 min on 2 cores; writes benchmarks/INNER_OUTER.md

DIR holds four MNIST-sized IDX .gz files (e.g. Fashion-MNIST's: apt-get download dataset-fashion-mnist,
dpkg -x it, usr/share/datasets/fashion-mnist). np 5 (4 workers), MLP, --epochs 3, sync and async; for
each --optimizer at its default learning rate (sgd 0.1, momentum 0.01, adam 0.001) the test accuracy
after training with H 1 (no outer step) and, at each H, with the outer momentum given as 0.9
(DiLoCo's) and 0.5 (--momenta), and with plain model averaging (--outer-optimizer sgd --outer-lr 1); the
mode's outer optimizer otherwise (sync nesterov, async delayed-nesterov, lr 0.7). Each cell: the median
over --seeds seeds, and each seed's figure. --optimizers and --momenta choose rows and columns, e.g.
--optimizers momentum,adam --momenta 0.7 (~5 min).
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
INNER = ("sgd", "momentum", "adam")  # each at its default --lr
AVERAGING = ["--outer-optimizer", "sgd", "--outer-lr", "1"]  # plain model averaging
WORKERS = 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="four MNIST-sized IDX .gz files")
    p.add_argument("--data-source", default="", help="where those files came from, for the report")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hs", default="4,16")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--optimizers", default=",".join(INNER), help="the inner optimizers' rows")
    p.add_argument("--momenta", default="0.9,0.5", help="the outer momenta's columns")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "INNER_OUTER.md"))
    args = p.parse_args()
    base = ["--dataset", "mnist", "--data-dir", args.data_dir, "--epochs", str(args.epochs)]
    hs = [int(h) for h in args.hs.split(",")]
    outer = {**{f"momentum {m}": ["--outer-momentum", m] for m in args.momenta.split(",")}, "plain averaging": AVERAGING}

    def cell(flags: list[str]) -> str:
        accs = [run_mpitrain(WORKERS + 1, [*base, *flags, "--seed", str(seed)])["test_accuracy"]
                for seed in range(args.seeds)]
        text = f"{statistics.median(accs):.4f} ({' / '.join(f'{a:.4f}' for a in accs)})"
        print(f"  {' '.join(flags)}: {text}", file=sys.stderr, flush=True)
        return text

    rows = []
    for mode in args.modes.split(","):
        for inner in args.optimizers.split(","):
            flags = ["--mode", mode, "--optimizer", inner]
            plain = cell(flags)
            for h in hs:
                rows.append(f"| {mode} | {inner} | {h} | {plain} | "
                            + " | ".join(cell([*flags, "--local-steps", str(h), *given]) for given in outer.values())
                            + " |")
    lines = ["# The outer momentum over each inner optimizer", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", f"- machine: {machine()}",
             f"- command: `python benchmarks/inner_outer.py --data-dir DIR` ({args.seeds} seeds, {args.epochs} "
             f"epochs, H {args.hs}, modes {args.modes}, optimizers {args.optimizers}, outer momenta {args.momenta})",
             f"- data: MNIST-sized{': ' + args.data_source if args.data_source else ''}",
             f"- np {WORKERS + 1} ({WORKERS} workers), MLP, each --optimizer at its default learning rate; the outer "
             "step is the mode's default outer optimizer (sync nesterov, async delayed-nesterov; lr 0.7) with the "
             "momentum given, or plain averaging (`--outer-optimizer sgd --outer-lr 1`)",
             "- each cell: test accuracy after training, the median over the seeds (each seed's)", "",
             "| mode | --optimizer | H | H 1 (no outer step) | " + " | ".join(outer) + " |",
             "|---" * (4 + len(outer)) + "|", *rows]
    record(args.out, "\n".join(lines) + "\n")
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
