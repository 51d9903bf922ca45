"""Time to accuracy with --local-steps H, on one host and across a shaped link (issue 46). Needs root
for the shaped links (network namespaces, benchmarks/netns.py); without it, the one-host rows only.

    sudo python benchmarks/time_to_accuracy.py --data-dir DIR   # writes benchmarks/TIME_TO_ACCURACY.md
    python benchmarks/time_to_accuracy.py --links one-host --hs 1,16 --out /tmp/TTA.md   # a smoke run

Every distributed run: 4 workers (np=5), MLP, batch 100, --eval-every every 1/--evals-per-epoch epoch of
global data with --eval-at-end (rank 0 copies the parameters then and evaluates the copies after
training: the workers train on while rank 0 evaluates, so evaluating at once and taking its time
out counted far too little training); the time to the target is the wall time since training
started of the first evaluated step at or above it (eval_history's training_seconds); each cell is the median over --seeds seeds (a seed that never reaches the
target counts as never). One process (no mpirun, batch 100, on one host) is the baseline every row is
also compared with. Across the link (--layout): by default rank 0 and workers 1-2 on host A, workers 3-4
on host B, the veth pair between them shaped with tc tbf in both directions; ps+2+2: rank 0 alone on
host A, workers 1-2 on B, 3-4 on C, every host's link to a bridge shaped both ways; every message over
TCP (UCX_TLS=tcp,self). Each
run is capped (--max-epochs); a run that never reaches the target says so. Accuracy after the
same samples is the last evaluation of each run (all runs see the same number of samples).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
import netns  # noqa: E402
from run import PY, env, machine, mpirun, run_mpitrain  # noqa: E402

LINKS = {"one-host": None, "1 Gbit/s": "1gbit", "100 Mbit/s": "100mbit", "10 Mbit/s": "10mbit"}
WORKERS = 4
ONE = "one process"  # the rows' mode for a single process's run
HS = "1,4,16,64"  # --hs: the H of each mode's rows
# --layout: how the ranks sit on the hosts across a shaped link (hydra fills a hostfile's hosts in order)
# and what the report says of it. "2+2": two hosts joined by one link. "ps+2+2": three hosts on a
# switch, each on its own shaped link, the parameter server alone on one as in TensorFlow's ps
# tasks: every async exchange crosses a link into rank 0's host, and sync's Allreduce crosses one.
LAYOUTS = {"2+2": ((3, 2), "rank 0 and 2 workers on host A, 2 workers on host B (network namespaces, a veth "
                           "pair shaped with tc tbf both ways)"),
           "ps+2+2": ((1, 2, 2), "rank 0 alone on host A, 2 workers on host B, 2 on host C (network namespaces on "
                                 "a bridge, each host's link shaped with tc tbf both ways)")}  # (ranks per host, words)
# The rows' modes (--modes) and their flags; async-shm: async over the node-shared store (across the
# link, host B's workers keep the message path and rank 0 applies their pushes into the store).
MODES = {"sync": ["--mode", "sync"], "async": ["--mode", "async"],
         "async-shm": ["--mode", "async", "--ps-transport", "shm"],
         # sync's gathered exchange (issue 80): quantised, and top-k of a quantised part, with error feedback
         "sync-int8": ["--mode", "sync", "--compress", "int8"], "sync-int4": ["--mode", "sync", "--compress", "int4"],
         "sync-top2-int8": ["--mode", "sync", "--compress", "int8", "--sparsify", "2"],
         # sync's outer exchange in flight during H/2 inner steps (--outer-overlap, flags(); no row at H 1)
         "sync-overlap": ["--mode", "sync"],
         # the outer exchange in 4 fragments, one every H/4 steps (--fragments, flags(); no row at H 1)
         "sync-fragments": ["--mode", "sync"],
         "sync-fragments-int4": ["--mode", "sync", "--compress", "int4"],  # each fragment's exchange in int4
         # ... as a reduce-scatter whose sums go in int4 too (--compress-replies: 2(W-1)/W of a part received, not W-1)
         "sync-int4-sums": ["--mode", "sync", "--compress", "int4", "--compress-replies"],
         "sync-int2-sums": ["--mode", "sync", "--compress", "int2", "--compress-replies"],
         "sync-overlap-int2-sums": ["--mode", "sync", "--compress", "int2", "--compress-replies"],  # and H/2 in flight
         "sync-fragments-int4-sums": ["--mode", "sync", "--compress", "int4", "--compress-replies"],
         # Streaming DiLoCo's three: fragments, each in flight for H/F/2 inner steps, in int4
         "sync-streaming": ["--mode", "sync", "--compress", "int4"],
         # async: the pushes compressed, rank 0's replies in float32
         "async-int8": ["--mode", "async", "--compress", "int8"], "async-int4": ["--mode", "async", "--compress", "int4"],
         "async-top2-int8": ["--mode", "async", "--compress", "int8", "--sparsify", "2"],
         # ... and rank 0's replies in the same scheme (--compress-replies)
         "async-int8-replies": ["--mode", "async", "--compress", "int8", "--compress-replies"],
         "async-int4-replies": ["--mode", "async", "--compress", "int4", "--compress-replies"],
         "async-int2-replies": ["--mode", "async", "--compress", "int2", "--compress-replies"],
         "async-int4-replies-overlap": ["--mode", "async", "--compress", "int4", "--compress-replies", "--overlap"],
         # async: a worker's next steps computed while its push travels (with --local-steps: from its own model)
         "async-overlap": ["--mode", "async", "--overlap"]}


FRAGMENTS = 4  # sync-fragments' F (H 4 and up)


def flags(dataset: list[str], mode: str, h: int, epochs: int, eval_every: int, seed: int) -> list[str]:
    return [*dataset, *MODES[mode], "--epochs", str(epochs), "--eval-every", str(eval_every), "--seed", str(seed),
            "--eval-at-end",
            *(["--local-steps", str(h)] if h > 1 else []),
            *(["--outer-overlap", str(h // 2)] if mode.startswith("sync-overlap") else []),
            *(["--outer-overlap", str(max(1, h // FRAGMENTS // 2))] if mode == "sync-streaming" else []),
            *(["--fragments", str(FRAGMENTS)] if mode.startswith("sync-fragments") or mode == "sync-streaming" else [])]


def run_across(names, addrs, wrapper, layout: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile, summary = Path(tmp) / "hosts", Path(tmp) / "s.json"
        hostfile.write_text("".join(f"{addr}:{n}\n" for addr, n in zip(addrs, LAYOUTS[layout][0])))
        cmd = ["ip", "netns", "exec", names[0], mpirun(), "-launcher", "ssh", "-launcher-exec", str(wrapper),
               "-f", str(hostfile), "-localhost", addrs[0], "-np", str(WORKERS + 1), PY, "-m", "mpitrain",
               "--no-progress", "--summary-json", str(summary), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**env(), **netns.OVER_TCP})
        if proc.returncode != 0:
            raise RuntimeError(f"mpitrain failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return json.loads(summary.read_text())


def to_target(summary: dict, target: float) -> float | None:
    hit = [e["training_seconds"] for e in summary["eval_history"] if e["test_accuracy"] >= target]
    return hit[0] if hit else None


def row(summaries: list[dict], target: float) -> dict:
    """The median over seeds of each figure; the time to the target is None if the median seed never got there."""
    times = sorted(to_target(s, target) for s in summaries if to_target(s, target) is not None)
    half = len(summaries) // 2
    return {"tta": times[half] if len(times) > half else None,
            "final": statistics.median(s["eval_history"][-1]["test_accuracy"] for s in summaries),
            "bytes": statistics.median(s["bytes_per_sample"] or 0 for s in summaries),  # one process: None
            "sps": statistics.median(s["samples_per_second"] for s in summaries),
            # a run that never reached the target took longer than its whole training time: the bound its ratios use
            "whole": statistics.median(s["eval_history"][-1]["training_seconds"] for s in summaries),
            "reached": f"{len(times)}/{len(summaries)}",
            # the share of the workers' wall time spent computing (issue 80's utilisation; one process: none)
            "util": statistics.median(s.get("compute_utilisation") or 0 for s in summaries)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="the four MNIST-sized IDX .gz files, e.g. Fashion-MNIST's: apt-get download dataset-fashion-mnist, dpkg -x it, usr/share/datasets/fashion-mnist (else --dataset digits)")
    p.add_argument("--data-source", default="", help="where those files came from, for the report")
    p.add_argument("--train-samples", type=int, default=60000, help="the training set's size (for --eval-every)")
    p.add_argument("--target", type=float, default=0.84)
    p.add_argument("--max-epochs", type=int, default=6)
    p.add_argument("--hs", default=HS)
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--modes", default="sync,async", help=f"of {', '.join(MODES)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--evals-per-epoch", type=int, default=16)
    p.add_argument("--layout", choices=LAYOUTS, default="2+2", help="across a shaped link: " + "; ".join(
        f"{k}: {v[1]}" for k, v in LAYOUTS.items()))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "TIME_TO_ACCURACY.md"))
    args = p.parse_args()
    dataset = ["--dataset", "mnist", "--data-dir", args.data_dir] if args.data_dir else ["--dataset", "digits"]
    n_train = args.train_samples if args.data_dir else 1437
    hs = [int(h) for h in args.hs.split(",")]
    links = args.links.split(",")
    modes = args.modes.split(",")
    results: dict = {}

    def measure(link: str, mode: str, h: int, go) -> None:
        """One row: --seeds runs of `mode` at H `h` through `go` (ONE: a single process, async's flags).
        Evaluations every 1/evals-per-epoch of an epoch of global data: a global step is one batch
        (async, one process) or one batch of every worker (sync)."""
        every = max(1, n_train // args.evals_per_epoch // (100 * (WORKERS if mode != ONE and MODES[mode][1] == "sync" else 1)))
        t0 = time.monotonic()
        runs_ = [go(flags(dataset, "async" if mode == ONE else mode, h, args.max_epochs, every, seed))
                 for seed in range(args.seeds)]
        results[(link, mode, h)] = row(runs_, args.target)
        print(f"[{link}] {mode} H {h}: {results[(link, mode, h)]} ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    def runs(go) -> None:
        for mode in modes:
            for h in hs:
                if h > 1 or not mode.startswith(("sync-fragments", "sync-overlap", "sync-streaming")):
                    measure(link, mode, h, go)

    for link in [x for x in links if LINKS[x] is None]:
        measure(link, ONE, 1, lambda a: run_mpitrain(0, a))  # no mpirun, no link: the baseline distributing has to beat
        runs(lambda a: run_mpitrain(WORKERS + 1, a))
    shaped = [x for x in links if LINKS[x] is not None]
    if shaped:
        try:
            with tempfile.TemporaryDirectory() as tmp, hosts(Path(tmp), args.layout) as (names, addrs, wrapper, ports):
                for link in shaped:
                    netns.shape(ports, LINKS[link])
                    runs(lambda a: run_across(names, addrs, wrapper, args.layout, a))
        except netns.Unavailable as e:
            print(f"time_to_accuracy: shaped links skipped: {e}", file=sys.stderr)
    record(args.out, "\n".join(report(results, args, links, hs, modes)) + "\n")
    print(Path(args.out).read_text())
    return 0


@contextlib.contextmanager
def hosts(workdir: Path, layout: str):
    """The namespace hosts of `layout`: (names, addresses, launcher wrapper, ports to shape)."""
    count = len(LAYOUTS[layout][0])
    if count == 2:
        with netns.two_hosts(workdir) as (names, addrs, wrapper, veths):
            yield names, addrs, wrapper, list(veths.items())
    else:
        with netns.switched_hosts(workdir, count) as made:
            yield made


def report(results: dict, args, links: list[str], hs: list[int], modes: list[str]) -> list[str]:
    data = "MNIST-sized" if args.data_dir else "digits"
    lines = ["# Time to accuracy with --local-steps H", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", f"- machine: {machine()}",
             f"- command: `python benchmarks/time_to_accuracy.py{' --data-dir DIR' if args.data_dir else ''}{chosen(args)}` (root for "
             f"the shaped links); {WORKERS} workers, MLP, batch 100, at most {args.max_epochs} epochs, the median of seeds "
             f"0-{args.seeds - 1}",
             f"- data: {data}{': ' + args.data_source if args.data_source else ''}",
             f"- target: test accuracy {args.target}; time = training seconds to the first evaluation at or above it "
             f"(evaluations every 1/{args.evals_per_epoch} epoch, of copies taken then and evaluated after training); `-`: the median seed did not reach it; "
             "`>`: the row compared with did not, so its whole training time stands in as a lower bound",
             f"- across the link: {LAYOUTS[args.layout][1]}, every message over TCP; on one host all 5 ranks share "
             "the 2 cores", "",
             "| link | mode | H | time to target (s) | seeds that reached it | vs H 1 of the mode | vs plain sync | vs one process "
             "| accuracy at the end | bytes through MPI per sample | samples/s | workers computing |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    one = results.get(("one-host", ONE, 1))  # no link: every link's rows are compared with it
    for link in links:
        base_sync = results.get((link, "sync", 1))
        for mode in (ONE, *modes):
            base = results.get((link, mode, 1))
            for h in (1,) if mode == ONE else hs:
                r = results.get((link, mode, h))
                if r is None:
                    continue
                t = r["tta"]
                util = f"{r['util']:.0%}" if r.get("util") else ""
                lines.append(f"| {link} | {mode} | {h} | {'-' if t is None else f'{t:.2f}'} | {r['reached']} | "
                             f"{ratio(base, t)} | {ratio(base_sync, t)} | {ratio(one, t)} | {r['final']:.4f} | {r['bytes']:,.0f} | "
                             f"{r['sps']:,.0f} | {util} |")
    return lines


def chosen(args) -> str:
    """The row-choosing flags given other than their defaults, as the command line had them."""
    given = (("--links", args.links, ",".join(LINKS)), ("--modes", args.modes, "sync,async"), ("--hs", args.hs, HS),
             ("--layout", args.layout, "2+2"), ("--max-epochs", str(args.max_epochs), "6"))
    return "".join(f" {flag} {shlex.quote(value)}" for flag, value, default in given if value != default)


def ratio(base: dict | None, t: float | None) -> str:
    """How many times shorter `t` is than `base`'s time to the target; where `base` never reached it, more than
    its whole training time over `t` ('>'); '' where `t` is missing."""
    if base is None or t is None:
        return ""
    return f"{base['tta'] / t:.2f}x" if base["tta"] is not None else f">{base['whole'] / t:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
