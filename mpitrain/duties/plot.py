"""`mpitrain plot RUN_DIR [RUN_DIR...] -o curves.png`: training curves from --log-dir folders.

Four panels: minibatch loss and test accuracy, each against global step and against wall time;
one line per run, labelled with its folder and mode. Reads each folder's events.jsonl.
`mpitrain plot --timeline TRACE.json -o timeline.png` draws a --timeline trace instead: one row
per rank (and thread), its phases in colour, over the last --window milliseconds of training
(ui.perfetto.dev shows the same file interactively).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpitrain.core.atomic import write_atomic
from mpitrain.core.config import UsageError
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode


def read_run(run_dir: str) -> dict:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no events.jsonl; pass folders written by --log-dir")
    run = {"label": Path(run_dir).name, "mode": "?", "train": [], "eval": []}
    lines = path.read_text().splitlines()
    offset = 0.0  # a resumed run's seconds restart at 0: they continue the earlier run's here
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) or _starts_run(lines[number:number + 1]):
                continue  # a run still writing, or killed, ends in half a line
            raise UsageError(f"{path}:{number} is not JSON; is it an mpitrain events.jsonl?") from None
        kind = event.get("event")
        if kind == "start":
            run["mode"] = event.get("mode", "?")
            # A resumed run goes on from its checkpoint's step: what the earlier run logged after
            # that step was lost with it, and is dropped (as TensorBoard's purge_step does).
            resumed_at = event.get("start_step", 0)
            for k in ("train", "eval"):
                run[k] = [e for e in run[k] if e["global_step"] <= resumed_at]
            kept = run["train"] + run["eval"]
            offset = max((e.get("seconds", 0.0) for e in kept), default=0.0)
        elif kind in ("train", "eval"):
            run[kind].append({**event, "seconds": event.get("seconds", 0.0) + offset})
    if not run["train"] and not run["eval"]:
        raise UsageError(f"{path} holds no training or evaluation events")
    return run


def save_figure(fig, out: str) -> None:
    """Whole or not at all (a full disk leaves no half image): a temporary file, then os.replace."""
    fmt = Path(out).suffix[1:].lower() or "png"
    write_atomic(Path(out), lambda f: fig.savefig(f, dpi=100, format=fmt), binary=True)


def _starts_run(lines: list[str]) -> bool:
    try:
        return bool(lines) and json.loads(lines[0]).get("event") == "start"
    except json.JSONDecodeError:
        return False


def has_accuracy_curves(runs: list[dict]) -> bool:
    """Whether any run evaluated at two steps or more (--eval-every): one final point is no curve."""
    return any(len({e["global_step"] for e in run["eval"] if "test_accuracy" in e}) >= 2 for run in runs)


def plot(runs: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = [("train", "loss", "global_step"), ("train", "loss", "seconds")]
    if has_accuracy_curves(runs):
        panels += [("eval", "test_accuracy", "global_step"), ("eval", "test_accuracy", "seconds")]
    else:
        say("mpitrain plot: no run evaluated during training (only at its end): drawing the loss only; "
            "train with --eval-every N for test-accuracy curves")
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(11, 3.75 * (len(panels) // 2)), constrained_layout=True,
                             squeeze=False)
    for (kind, y, x), ax in zip(panels, axes.flat):
        for run in runs:
            pts = [(e[x], e[y]) for e in run[kind] if y in e and e[y] == e[y]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if kind == "eval" else None, markersize=3,
                        label=f"{run['label']} ({run['mode']})")
        ax.set_xlabel("global step" if x == "global_step" else "wall time (s)")
        ax.set_ylabel("minibatch loss" if y == "loss" else "test accuracy")
        if y == "loss" and ax.has_data():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.has_data():  # an empty legend is a matplotlib warning
            ax.legend(fontsize=8)
    fig.suptitle("mpitrain: " + ", ".join(f"{r['label']} ({r['mode']})" for r in runs))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out)
    plt.close(fig)


PHASE_COLOURS = {"compute": "tab:blue", "push": "tab:orange", "pull": "tab:red", "wait": "lightgrey",
                 "allreduce": "tab:purple", "apply": "tab:green", "eval": "gold", "checkpoint": "black"}


def read_trace(path: str) -> dict:
    try:
        trace = json.loads(Path(path).read_text())
        events = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is not a trace written by --timeline (JSON with traceEvents)") from None
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise UsageError(f"{path} holds no spans")
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {"spans": spans, "names": names}


# The phases of a training step. The final evaluation and checkpoint come after the last step: a
# window ending at the trace's end showed only them.
STEP_PHASES = ("compute", "push", "pull", "wait", "allreduce", "apply")


def training_end(spans: list[dict]) -> float:
    """When the last step's span ends (the trace's end if it has no step)."""
    steps = [e["ts"] + e["dur"] for e in spans if e["name"] in STEP_PHASES]
    return max(steps) if steps else max(e["ts"] + e["dur"] for e in spans)


def plot_timeline(trace: dict, out: str, window_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = trace["spans"]
    end = training_end(spans)
    begin = end - window_ms * 1e3
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(tracks) + 1.6), constrained_layout=True)
    for row, (pid, tid) in enumerate(tracks):
        bars = [(e["ts"], e["dur"], e["name"]) for e in spans
                if (e["pid"], e["tid"]) == (pid, tid) and e["ts"] + e["dur"] >= begin and e["ts"] <= end]
        for name in PHASE_COLOURS:
            mine = [((ts - begin) / 1e3, dur / 1e3) for ts, dur, n in bars if n == name]
            if mine:
                ax.broken_barh(mine, (row - 0.4, 0.8), color=PHASE_COLOURS[name])
    labels = [trace["names"].get(pid, f"rank {pid}").split(" CPU")[0] + (" (gradient thread)" if tid else "")
              for pid, tid in tracks]
    ax.set_yticks(range(len(tracks)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, window_ms)
    ax.set_xlabel(f"milliseconds (the last {window_ms:g} ms of training)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()], ncol=len(PHASE_COLOURS),
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpitrain plot", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", metavar="RUN_DIR")
    p.add_argument("--timeline", metavar="TRACE", help="draw a --timeline trace instead of training curves")
    p.add_argument("--window", type=float, default=50.0, metavar="MS",
                   help="--timeline: the last MS milliseconds of training (its last step's end; default: 50)")
    p.add_argument("-o", "--output", default=None, help="curves.png (or timeline.png with --timeline)")
    args = p.parse_args(argv)
    try:
        if args.timeline and args.runs:
            raise UsageError("give either run folders or --timeline TRACE, not both")
        if not args.timeline and not args.runs:
            raise UsageError("give one or more --log-dir folders, or --timeline TRACE")
        if args.window <= 0:
            raise UsageError(f"--window must be a positive number of milliseconds (got {args.window:g})")
        trace = read_trace(args.timeline) if args.timeline else None
        runs = [read_run(r) for r in args.runs]
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("mpitrain plot needs matplotlib: pip install 'mpitrain[plot]'") from None
    except UsageError as e:
        say(f"mpitrain plot: error: {e}", sys.stderr)
        return ExitCode.USAGE
    out = args.output or ("timeline.png" if trace is not None else "curves.png")
    try:
        if trace is not None:
            plot_timeline(trace, out, args.window)
        else:
            plot(runs, out)
    except OSError as e:  # a full disk, a quota, a missing or read-only folder
        say(f"mpitrain plot: error: {out} not written: {e.strerror or e} ({Path(out).resolve().parent}); "
            f"free space or pick another -o", sys.stderr)
        return ExitCode.OUTPUTS_INCOMPLETE
    what = f"{len(trace['spans']):,} spans" if trace is not None else f"{len(runs)} run(s)"
    say(f"mpitrain plot: wrote {out} ({what})")
    return 0
