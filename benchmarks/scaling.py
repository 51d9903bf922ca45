"""Scaling on many cores: async and sync at np = 2, 3, 5, 9, 16 on NumPy, against the compute
ceiling of as many independent processes and against PyTorch DDP (gloo) with as many workers.

    python benchmarks/scaling.py --json scaling.json          # on a machine with >= 16 cores (~6 min)
    python benchmarks/scaling.py --report scaling.json --out benchmarks/SCALING.md --plot docs/scaling.png

np counts every rank: np=16 is rank 0 and 15 workers, compared with 15 independent processes and
DDP with 15 processes. One BLAS thread per process, so no rank shares a core at np <= cores.
Async runs STEPS x workers global steps (each worker about STEPS gradients); sync runs STEPS
global steps (each one gradient from every worker); DDP runs --torch-steps per process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import add_saved_run_flags, machine, measured_or_saved, median_row, run_independent, run_mpitrain, run_torch  # noqa: E402

NPS = (2, 3, 5, 9, 16)
MODELS = {"mlp": ("784-100-10", 1500), "softmax": ("784-10", 4000)}  # steps per worker: ~1 s of compute
KINDS = ("async", "sync", "compute ceiling", "PyTorch DDP gloo")
# NumPy, said outright: --device auto takes the GPU where CuPy sees one, and on the lent GPU machine
# (2026-11-23) every "NumPy" cell of this table ran CuPy processes sharing one H100 (docs/gpu.md).
CPU_BASE = ["--device", "cpu", "--dataset", "synthetic"]


def measured_on(reps: int, **more) -> dict:
    """The head of a results file: when, where, how many repetitions, and what else the table needs."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine().replace("; no GPU on this machine", ""), "cores": os.cpu_count(), "reps": reps, **more}


def measure_row(runs: dict, reps: int, label: str) -> dict:
    """Each of `runs` (name -> one run), `reps` times: its median row (None where every try failed)."""
    row = {}
    for kind, fn in runs.items():
        got = []
        for rep in range(reps):
            print(f"[{label} rep {rep + 1}/{reps}] {kind}", file=sys.stderr, flush=True)
            try:
                got.append(fn())
            except Exception as exc:  # one failed cell must not cost the table
                print(f"  failed: {str(exc)[-500:]}", file=sys.stderr, flush=True)
        row[kind] = median_row(got)
    return row


def measure(nps: tuple[int, ...], reps: int, torch_steps: int, save=lambda res: None, models=tuple(MODELS)) -> dict:
    res = measured_on(reps, torch_steps=torch_steps, models={})
    for model in models:
        steps = MODELS[model][1]
        table: dict[str, dict] = {}
        for np_ in nps:
            w = np_ - 1
            base = CPU_BASE + ["--model", model]
            runs = {
                "async": lambda: run_mpitrain(np_, [*base, "--steps", str(steps * w)]),
                "sync": lambda: run_mpitrain(np_, [*base, "--steps", str(steps), "--mode", "sync"]),
                "compute ceiling": lambda: run_independent(w, [*base, "--steps", str(steps)]),
                "PyTorch DDP gloo": lambda: run_torch(w, model, torch_steps),
            }
            table[str(np_)] = measure_row(runs, reps, f"{model} np={np_}")
            res["models"][model] = table
            save(res)  # a run cut short still leaves every finished cell
    return res


SERVER_KINDS = {  # --servers: name -> (extra ranks beside the workers, flags)
    "async --num-ps 1": (1, []), "async --num-ps 2": (2, ["--num-ps", "2"]), "async --num-ps 4": (4, ["--num-ps", "4"]),
    "async --ps-transport shm": (1, ["--ps-transport", "shm"]),
}


def measure_servers(workers: tuple[int, ...], reps: int, save=lambda res: None, model: str = "mlp") -> dict:
    """--servers: at each worker count, async with 1, 2 and 4 parameter servers and with the
    shared-memory store, against the compute ceiling of as many independent processes."""
    steps = MODELS[model][1]
    res = measured_on(reps, model=model, servers={})
    base = CPU_BASE + ["--model", model]
    for w in workers:
        runs = {"compute ceiling": lambda: run_independent(w, [*base, "--steps", str(steps)])}
        runs.update({kind: (lambda k=k, flags=flags: run_mpitrain(w + k, [*base, "--steps", str(steps * w), *flags]))
                     for kind, (k, flags) in SERVER_KINDS.items()})
        res["servers"][str(w)] = measure_row(runs, reps, f"{model} {w} workers")
        save(res)
    return res


def report_servers(res: dict) -> str:
    kinds = [k for k in SERVER_KINDS]
    lines = ["# mpitrain async with several parameter servers on one many-core machine (NumPy, CPU)", "",
             f"- date: {res['date']}", f"- machine: {res['machine']} ({res['cores']} cores)",
             "- command: `python benchmarks/scaling.py --servers 8,15 --json servers.json`",
             f"- {res['model']} ({MODELS[res['model']][0]}), batch 100 per worker; each cell samples/s, "
             f"median of {res['reps']} run(s), with its share of the compute ceiling and the servers' busy share; "
             "ranks = workers + servers (15 workers and 4 servers oversubscribe 16 cores)", "",
             "| workers | compute ceiling | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for w, row in res["servers"].items():
        ceiling = (row.get("compute ceiling") or {}).get("rate")
        cells = []
        for k in kinds:
            r = row.get(k)
            if not r:
                cells.append("failed")
                continue
            share = f" ({r['rate'] / ceiling:.2f}x)" if ceiling else ""
            busy = f", busy {100 * r['busy']:.0f}%" if r.get("busy") is not None else ""
            cells.append(f"{r['rate']:,.0f}{share}{busy}")
        lines.append(f"| {w} | {f'{ceiling:,.0f}' if ceiling else 'failed'} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def report(res: dict) -> str:
    if "servers" in res:
        return report_servers(res)
    lines = ["# mpitrain scaling on one many-core machine (NumPy, CPU)", "",
             f"- date: {res['date']}", f"- machine: {res['machine']}",
             "- command: `python benchmarks/scaling.py --json scaling.json`, tables and plot by `--report`",
             f"- each cell: median of {res['reps']} run(s), samples/s over the training (start-up excluded); "
             "synthetic MNIST-shaped data, batch 100 per worker, SGD, one BLAS thread per process; "
             f"DDP: {res['torch_steps']} steps per process", ""]
    for model, table in res["models"].items():
        shape = MODELS[model][0]
        lines += [f"## {model} ({shape})", "",
                  "| np (workers) | async | sync | compute ceiling | async / ceiling | sync / ceiling "
                  "| PyTorch DDP gloo | async / DDP | sync / DDP | rank 0 busy (async) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for np_, row in table.items():
            rate = {k: (row.get(k) or {}).get("rate") for k in KINDS}

            def cell(v):
                return f"{v:,.0f}" if v else "failed"

            def ratio(a, b):
                return f"{rate[a] / rate[b]:.2f}x" if rate[a] and rate[b] else "n/a"

            busy = (row.get("async") or {}).get("busy")
            lines.append(f"| {np_} ({int(np_) - 1}) | {cell(rate['async'])} | {cell(rate['sync'])} "
                         f"| {cell(rate['compute ceiling'])} | {ratio('async', 'compute ceiling')} "
                         f"| {ratio('sync', 'compute ceiling')} | {cell(rate['PyTorch DDP gloo'])} "
                         f"| {ratio('async', 'PyTorch DDP gloo')} | {ratio('sync', 'PyTorch DDP gloo')} "
                         f"| {f'{100 * busy:.0f}%' if busy is not None else ''} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["models"]), figsize=(6 * len(res["models"]), 4.2))
    for ax, (model, table) in zip(list(axes), res["models"].items()):
        workers = [int(n) - 1 for n in table]
        for kind, style in zip(KINDS, ("o-", "s-", "k--", "^:")):
            ys = [(row.get(kind) or {}).get("rate") for row in table.values()]
            pts = [(w, y) for w, y in zip(workers, ys) if y]
            if pts:
                ax.plot(*zip(*pts), style, label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.set_xlabel("workers (np - 1)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{model} ({MODELS[model][0]}), batch 100 per worker")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"mpitrain on {res['cores']} cores, NumPy: throughput vs workers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nps", default=",".join(map(str, NPS)))
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--torch-steps", type=int, default=500)
    p.add_argument("--servers", metavar="W[,W]", help="instead: async with 1, 2, 4 servers and shm at W workers "
                   "(the first of --models)")
    add_saved_run_flags(p, "benchmarks/SCALING.md")
    p.add_argument("--plot", help="draw the curve here (e.g. docs/scaling-16core.png); needs matplotlib")
    args = p.parse_args()
    nps, models = tuple(int(n) for n in args.nps.split(",")), tuple(args.models.split(","))
    if args.servers:
        workers = tuple(int(w) for w in args.servers.split(","))
        res = measured_or_saved(args, lambda save: measure_servers(workers, args.reps, save, models[0]))
    else:
        res = measured_or_saved(args, lambda save: measure(nps, args.reps, args.torch_steps, save, models))
    text = report(res)
    if args.out:
        record(args.out, text)
    if args.plot and "models" in res:
        plot(res, args.plot)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
