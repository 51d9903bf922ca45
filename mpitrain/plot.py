"""`mpitrain plot RUN_DIR [RUN_DIR...] -o curves.png`: training curves from --log-dir folders.

Four panels: minibatch loss and test accuracy, each against global step and against wall time;
one line per run, labelled with its folder and mode. Reads each folder's events.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpitrain.config import UsageError
from mpitrain.metrics import say


def read_run(run_dir: str) -> dict:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no events.jsonl; pass folders written by --log-dir")
    run = {"label": Path(run_dir).name, "mode": "?", "train": [], "eval": []}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(path.read_text().splitlines()):
                continue  # a run still writing (or killed) may end in half a line
            raise UsageError(f"{path}:{number} is not JSON; is it an mpitrain events.jsonl?") from None
        kind = event.get("event")
        if kind == "start":
            run["mode"] = event.get("mode", "?")
        elif kind in ("train", "eval"):
            run[kind].append(event)
    if not run["train"] and not run["eval"]:
        raise UsageError(f"{path} holds no training or evaluation events")
    return run


def plot(runs: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    panels = [(0, 0, "train", "loss", "global_step"), (0, 1, "train", "loss", "seconds"),
              (1, 0, "eval", "test_accuracy", "global_step"), (1, 1, "eval", "test_accuracy", "seconds")]
    for row, col, kind, y, x in panels:
        ax = axes[row][col]
        for run in runs:
            pts = [(e[x], e[y]) for e in run[kind] if y in e and e[y] == e[y]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3,
                        label=f"{run['label']} ({run['mode']})")
        ax.set_xlabel("global step" if x == "global_step" else "wall time (s)")
        ax.set_ylabel("minibatch loss" if y == "loss" else "test accuracy")
        if y == "loss":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("mpitrain: " + ", ".join(f"{r['label']} ({r['mode']})" for r in runs))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpitrain plot", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default="curves.png")
    args = p.parse_args(argv)
    try:
        runs = [read_run(r) for r in args.runs]
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("mpitrain plot needs matplotlib: pip install 'mpitrain[plot]'") from None
    except UsageError as e:
        say(f"mpitrain plot: error: {e}", sys.stderr)
        return 2
    plot(runs, args.output)
    say(f"mpitrain plot: wrote {args.output} ({len(runs)} run(s))")
    return 0
