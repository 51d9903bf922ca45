"""What the wire costs: async and sync, each --compress, across a shaped link between two "hosts"
(network namespaces joined by a veth pair, shaped with tc's token bucket). Needs root, iproute2, tc.

    sudo python benchmarks/slowlink.py            # ~4 min on 2 cores; writes benchmarks/SLOWLINK.md

Async runs rank 0 alone on host A and both workers on host B, so every gradient and every reply
crosses the link; sync runs rank 0 and worker 1 on A and worker 2 on B, so the workers' Allreduce
crosses it. Bytes per global step are the payloads that cross the link (headers aside):
async, one gradient up and one parameter vector down; sync, the Allreduce of the gradient between
the two workers (MPICH's two-rank allreduce sends the whole vector each way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
import netns  # noqa: E402
from run import PY, env, machine, mpirun  # noqa: E402

LINKS = [("unshaped veth", None), ("10 Gbit/s", "10gbit"), ("1 Gbit/s", "1gbit")]
WIRE_BYTES = {"none": 4, "fp16": 2, "bf16": 2}
N_PARAMS = {"mlp": 79_510, "softmax": 7_850}
HOSTS = {"async": (1, 2), "sync": (2, 1)}  # ranks on host A, on host B


def run_across(names, addrs, wrapper, mode: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile, summary = Path(tmp) / "hosts", Path(tmp) / "s.json"
        a, b = HOSTS[mode]
        hostfile.write_text(f"{addrs[0]}:{a}\n{addrs[1]}:{b}\n")
        cmd = ["ip", "netns", "exec", names[0], mpirun(), "-launcher", "ssh", "-launcher-exec", str(wrapper),
               "-f", str(hostfile), "-localhost", addrs[0], "-np", "3", PY, "-m", "mpitrain", "--no-progress",
               "--mode", mode, "--summary-json", str(summary), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env(), **netns.OVER_TCP})
        if proc.returncode != 0:
            raise RuntimeError(f"mpitrain failed ({proc.returncode}): {proc.stderr[-1500:]}")
        return json.loads(summary.read_text())


def bytes_per_step(model: str, compress: str) -> int:
    return 2 * N_PARAMS[model] * WIRE_BYTES[compress]  # async: up + down; sync: each way; the same count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--models", default="mlp,softmax")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "SLOWLINK.md"))
    args = p.parse_args()
    rows = [(m, mode, c) for m in args.models.split(",") for mode in ("async", "sync") for c in ("none", "fp16", "bf16")]
    raw: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp, netns.two_hosts(Path(tmp)) as (names, addrs, wrapper, veths):
            for link, rate in LINKS:
                netns.shape(veths.items(), rate)
                for rep in range(args.reps):
                    for model, mode, compress in rows:
                        print(f"[{link} rep {rep + 1}/{args.reps}] {model} {mode} {compress}", file=sys.stderr,
                              flush=True)
                        s = run_across(names, addrs, wrapper, mode, ["--dataset", "synthetic", "--model", model,
                                                                    "--steps", str(args.steps), "--compress", compress])
                        raw.setdefault((link, model, mode, compress), []).append(s["samples_per_second"])
    except netns.Unavailable as e:
        print(f"slowlink: skipped: {e}", file=sys.stderr)
        return 0
    lines = ["# mpitrain across a shaped link", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"- machine: {machine()}",
             f"- command: `python benchmarks/slowlink.py` (root); {args.steps} global steps, batch 100, synthetic "
             f"MNIST-shaped data; each cell the median of {args.reps} interleaved runs",
             "- two network namespaces joined by a veth pair, both ends shaped with `tc qdisc ... tbf rate R` (no added "
             "latency: this kernel has no netem); every message over TCP (`UCX_TLS=tcp,self`: by default UCX takes "
             "shared memory between the namespaces and the shaping would change nothing); "
             "async: rank 0 on host A, both workers on host B; sync: rank 0 and worker 1 on A, worker 2 on B", "",
             "| link | model | mode | bytes across per global step | float32 | fp16 | bf16 | bf16 vs float32 |",
             "|---|---|---|---|---|---|---|---|"]
    for link, _ in LINKS:
        for model in args.models.split(","):
            for mode in ("async", "sync"):
                med = {c: statistics.median(raw[(link, model, mode, c)]) for c in ("none", "fp16", "bf16")}
                lines.append(f"| {link} | {model} | {mode} | {bytes_per_step(model, 'none'):,} / "
                             f"{bytes_per_step(model, 'bf16'):,} (16-bit) | {med['none']:,.0f} | {med['fp16']:,.0f} "
                             f"| {med['bf16']:,.0f} | {med['bf16'] / med['none']:.2f}x |")
    text = "\n".join(lines) + "\n"
    record(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
