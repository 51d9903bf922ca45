"""Does async keep its accuracy as workers grow, with no flag? (issue 48)

    python benchmarks/quality_scale.py --data-dir DIR      # ~30 min on 2 cores; writes benchmarks/QUALITY_SCALE.md
    python benchmarks/quality_scale.py --data-dir DIR --seeds 5 --configs 0 5 --out benchmarks/QUALITY_SCALE.md

Held-out accuracy after the same number of epochs (mpitrain's default, 50) at 2, 4, 8 and 16
workers (np = workers + 1), MLP, three seeds, for: async with today's defaults; async as it was
before them (--overlap, no damping); each remedy alone; and sync (its defaults). Data: an MNIST-
sized set from DIR (the four IDX files; not shipped, name its source with --data-source), digits,
and synthetic (digits with --batch-size 44 at every size: 16 workers' shards are 89 images, and
batch 50 took one of them per epoch, 57% of the samples 2 workers see; 44 takes 98-99% at every size). Each
run's staleness (mean and 99th percentile) is recorded beside its accuracy.
On 2 cores 17 ranks are heavily oversubscribed: the accuracy is what this measures, not speed.
Results go to --json as they come (--resume continues an interrupted run from it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from run import machine, run_mpitrain  # same folder

from support import AUTO_OVERLAP_MAX_WORKERS, DEFAULT_EPOCHS, DEFAULT_STALENESS_TOLERANCE  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    ("async, defaults", ["--mode", "async"]),
    ("async, the old defaults (--overlap --staleness-lr 0)", ["--mode", "async", "--overlap", "--staleness-lr", "0"]),
    ("async --no-overlap --staleness-lr 0", ["--mode", "async", "--no-overlap", "--staleness-lr", "0"]),
    ("async --staleness-lr (K 1: lr / staleness)", ["--mode", "async", "--staleness-lr"]),
    ("async --delay-compensation (with the defaults)", ["--mode", "async", "--delay-compensation"]),
    ("sync, defaults", ["--mode", "sync"]),
    ("async --overlap (the defaults' damping)", ["--mode", "async", "--overlap"]),
]
DEFAULT = CONFIGS[0][0]
# Whole batches per epoch (data.steps_per_epoch): 44 uses 704 of 719, 352/359, 176/179, 88/89 examples of
# each worker's shard at 2, 4, 8, 16 workers. QUALITY_SCALE.md's first run used 50: one batch of a 16-worker
# shard of 89 per epoch, 57% of the samples 2 workers see.
DIGITS_BATCH = 44


def dataset_flags(name: str, data_dir: str | None) -> list[str]:
    if name == "mnist":
        return ["--dataset", "mnist", "--data-dir", data_dir]
    if name == "digits":  # 1,438 training images: 16 shards of 89, smaller than the default batch of 100
        return ["--dataset", name, "--batch-size", str(DIGITS_BATCH)]
    return ["--dataset", name]


def measure(args, results: dict) -> None:
    for dataset in args.datasets:
        for workers in args.sizes:
            for seed in range(args.seeds):
                for name, flags in args.configs:
                    key = f"{dataset}|{workers}|{seed}|{name}"
                    if key in results:
                        continue
                    cmd = [*dataset_flags(dataset, args.data_dir), "--model", "mlp", *flags, "--seed", str(seed),
                           *(["--epochs", str(args.epochs)] if args.epochs else [])]
                    try:
                        s = run_mpitrain(workers + 1, cmd)
                    except RuntimeError as e:  # mpitrain's own divergence stop (exit 4) is a result too
                        if "diverged" not in str(e):
                            raise
                        results[key] = {"accuracy": None, "diverged": True}
                        print(f"{key}: diverged", file=sys.stderr, flush=True)
                        Path(args.json).write_text(json.dumps(results, indent=1))
                        continue
                    st = s.get("staleness") or {}
                    results[key] = {"accuracy": s["test_accuracy"], "staleness_mean": st.get("mean"),
                                    "staleness_p99": st.get("p99"), "samples_per_second": s["samples_per_second"]}
                    print(f"{key}: {s['test_accuracy']:.4f} staleness {st.get('mean')}", file=sys.stderr, flush=True)
                    Path(args.json).write_text(json.dumps(results, indent=1))


def cell(results: dict, dataset: str, workers: int, name: str, seeds: int, field: str = "accuracy") -> list:
    """The seeds' values of one field; a run that diverged (exit 4) has none."""
    runs = [results[k] for k in (f"{dataset}|{workers}|{s}|{name}" for s in range(seeds)) if k in results]
    return [r[field] for r in runs if r.get(field) is not None]


def diverged(results: dict, dataset: str, workers: int, name: str, seeds: int) -> int:
    return sum(bool(results.get(f"{dataset}|{workers}|{s}|{name}", {}).get("diverged")) for s in range(seeds))


def table(results: dict, args, dataset: str) -> tuple[list[str], list[str]]:
    sizes = args.sizes
    lines = ["| | " + " | ".join(f"{w} workers" for w in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    med = {}
    for name, _ in args.configs:
        row = []
        for w in sizes:
            accs = cell(results, dataset, w, name, args.seeds)
            med[name, w] = statistics.median(accs) if accs else float("nan")
            text = f"{med[name, w]:.2%} ({min(accs):.2%}-{max(accs):.2%})" if accs else ""
            lost = diverged(results, dataset, w, name, args.seeds)
            row.append(", ".join(filter(None, [text, f"{lost} diverged" if lost else ""])) or "-")
        bold = "**" if name == DEFAULT else ""
        lines.append(f"| {bold}{name}{bold} | " + " | ".join(row) + " |")
    stale = []
    for w in sizes:
        means = cell(results, dataset, w, DEFAULT, args.seeds, "staleness_mean")
        p99 = cell(results, dataset, w, DEFAULT, args.seeds, "staleness_p99")
        stale.append(f"{statistics.median(means):.1f} / {statistics.median(p99):g}" if means else "-")
    lines.append("| staleness of the defaults (mean / p99) | " + " | ".join(stale) + " |")
    for name, _ in args.configs:  # accuracy is what this measures, but what each row costs in speed goes with it
        rates = [cell(results, dataset, w, name, args.seeds, "samples_per_second") for w in sizes]
        lines.append(f"| samples/s, {name} (median) | " + " | ".join(f"{statistics.median(r):,.0f}" if r else "-"
                                                                       for r in rates) + " |")
    verdicts = []
    base = med.get((DEFAULT, sizes[0]))
    for w in sizes[1:]:
        got = med.get((DEFAULT, w))
        if base is not None and got is not None:
            ok = got >= base - 0.005
            verdicts.append(f"{w} workers {got:.2%} vs {sizes[0]} workers {base:.2%}: "
                            f"{'within' if ok else '**not** within'} 0.5 point")
    return lines, verdicts


def command_args(argv: list[str]) -> list[str]:
    """This run's flags for the results file: the data folder as DIR; its source (named below) and where
    this machine kept the runs left out."""
    out, skip = [], False
    for prev, a in zip([None, *argv], argv):
        if skip:
            skip = False
        elif a == "--resume":
            continue
        elif a.split("=")[0] in ("--data-source", "--json", "--out"):
            skip = "=" not in a
        else:
            out.append("DIR" if prev == "--data-dir" else a)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="the four MNIST-sized IDX .gz files (left out: digits and synthetic only)")
    p.add_argument("--data-source", default="", help="where the IDX files came from, for the results file")
    p.add_argument("--datasets", nargs="+", default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16], help="worker counts")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--configs", type=int, nargs="+", default=None,
                   help="which rows, by number from 0 (" + "; ".join(f"{i}: {n}" for i, (n, _) in enumerate(CONFIGS))
                   + "); default all")
    p.add_argument("--epochs", type=int, default=None, help=f"default: mpitrain's ({DEFAULT_EPOCHS})")
    p.add_argument("--json", default="/tmp/quality_scale.json")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --json")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "QUALITY_SCALE.md"))
    args = p.parse_args()
    args.configs = [CONFIGS[i] for i in args.configs] if args.configs is not None else CONFIGS
    if DEFAULT not in dict(args.configs):
        p.error("--configs must include 0, the defaults: the verdicts compare them")
    if args.datasets is None:
        args.datasets = (["mnist"] if args.data_dir else []) + ["digits", "synthetic"]
    results = json.loads(Path(args.json).read_text()) if args.resume and Path(args.json).exists() else {}
    t0 = time.monotonic()
    measure(args, results)
    out = ["# Async accuracy as workers grow, with the defaults", "",
           f"`python {' '.join(['benchmarks/quality_scale.py', *command_args(sys.argv[1:])])}` -- MLP, "
           f"{args.epochs or DEFAULT_EPOCHS} epochs at every size (the same samples seen), np = workers + 1, "
           f"{args.seeds} seeds; each cell is the median test accuracy of rank 0's final parameters (lowest-highest). "
           f"The defaults: async overlaps up to {AUTO_OVERLAP_MAX_WORKERS} workers and applies a gradient more than "
           f"{DEFAULT_STALENESS_TOLERANCE:g} updates stale at learning rate x {DEFAULT_STALENESS_TOLERANCE:g} / staleness "
           "(config.AUTO_OVERLAP_MAX_WORKERS, DEFAULT_STALENESS_TOLERANCE).", "",
           f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {machine()}. "
           f"{len(results)} runs ({(time.monotonic() - t0) / 60:.0f} min in this invocation; --resume keeps earlier ones). "
           "Staleness: of the applied gradients, in updates.", ""]
    for dataset in args.datasets:
        lines, verdicts = table(results, args, dataset)
        source = f" ({args.data_source})" if dataset == "mnist" and args.data_source else ""
        out += [f"## {dataset}{source}", "", *lines, ""]
        out += [f"- Defaults: {v}." for v in verdicts] + [""]
    record(args.out, "\n".join(out))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
