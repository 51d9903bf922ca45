"""How many workers one async parameter server can feed (issue 79): its gradients/s with workers that
do not compute, against the memory-bound limit of the same work in one process.

    python benchmarks/server.py [--workers 1,2,4] [--steps 20000] [--rounds 3] [--out benchmarks/SERVER.md]
    python benchmarks/server.py --against /tmp/base [--workers 2] [--rounds 7]

--against TREE: an interleaved A/B of the served figures, this checkout against another (a `git worktree` of
the commit to compare with), round by round, the ratios' medians reported.

Three figures per model size (MLP 784-100-10, 79,510 parameters; softmax 784-10, 7,850), all on this machine:

- limit: one process, the server's work at memory speed: a gradient copied into a receive buffer, an SGD
  apply in place, the parameters copied out into a reply buffer. Microseconds per gradient.
- served: `mpirun -np K+1` of the real job (rank 0 the real server, its loop, its checks and its duties),
  K fake workers whose gradient step is a copy of a precomputed gradient (GradientSource.compute replaced in
  this script's child): gradients/s, and rank 0's CPU microseconds per gradient (the summary's
  ps_busy_fraction x training seconds / gradients).
- one worker: the same model's steps/s in one process (`python -m mpitrain` without mpirun, batch 100).

"Workers fed" = served gradients/s at K workers / one worker's steps/s. With K+1 ranks on a machine of fewer
cores the fake workers share the cores with the server (said in the table, not hidden), so the table also
gives what rank 0's CPU time per gradient allows with a core of its own, and the workers that would feed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402
from run import env, machine, mpirun  # noqa: E402  (same folder)

SIZES = {"mlp": ["--model", "mlp", "--hidden", "100"], "softmax": ["--model", "softmax"]}
PARAMS = {"mlp": 784 * 100 + 100 + 100 * 10 + 10, "softmax": 784 * 10 + 10}
# --device cpu: on a machine with a GPU, auto would put the one worker and the server there (GPU.md, section 4)
DATA = ["--device", "cpu", "--dataset", "synthetic", "--synthetic-samples", "12000", "--batch-size", "100",
        "--lr", "0.01"]

CHILD = """
import ast
import sys
import numpy as np
import mpitrain
sys.path.insert(0, BENCHMARKS)  # this folder, written in by served()
from support import gradients  # (PYTHONPATH=TREE's, with --against)

rng = np.random.default_rng(mpitrain.rank())
fixed = {}

def compute(self, params, grad, step=0):  # a fake worker: no batch, no model, the precomputed gradient
    g = fixed.get(grad.size)
    if g is None:
        g = fixed[grad.size] = (rng.standard_normal(grad.size) * 1e-4).astype(grad.dtype)
    np.copyto(grad, g)
    self.batches.taken += 1
    return 0.5

gradients.GradientSource.compute = compute


def typed(v):
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v

options = {k: typed(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])}
mpitrain.train(**options, progress=False, summary_json=sys.argv[1])
"""


def limit_us(n: int, rounds: int = 2000) -> float:
    """The server's work on one gradient at memory speed, in one process: median microseconds."""
    import numpy as np

    rng = np.random.default_rng(0)
    wire = rng.standard_normal(n).astype(np.float32)  # what a worker sent
    inbox, params, outbox = np.empty(n, np.float32), rng.standard_normal(n).astype(np.float32), np.empty(n, np.float32)
    scratch = np.empty(n, np.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(inbox, wire)  # the receive
        np.multiply(inbox, 0.01, out=scratch)  # the apply, no temporary
        np.subtract(params, scratch, out=params)
        np.copyto(outbox, params)  # the reply
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def option_kwargs(args: list[str]) -> list[str]:
    """['--model', 'mlp', ...] as the API's key=value words for the child."""
    out = []
    for flag, value in zip(args[::2], args[1::2]):
        out.append(f"{flag[2:].replace('-', '_')}={value}")
    return out


def served(k: int, size: str, steps: int, tmp: Path, tree: str | None = None) -> dict:
    script, summary = tmp / "fake_workers.py", tmp / "served.json"
    script.write_text(CHILD.replace("BENCHMARKS", repr(str(Path(__file__).resolve().parent)), 1))
    kw = option_kwargs(SIZES[size] + DATA + ["--steps", str(steps)])
    cmd = [mpirun(), "-np", str(k + 1), sys.executable, str(script), str(summary), *kw]
    e = env() if tree is None else {**env(), "PYTHONPATH": tree}  # before the editable install's path
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=e, timeout=900)
    s = json.loads(summary.read_text())
    grads = s["global_step"]
    return {"per_s": grads / s["wall_seconds"], "server_us": s["ps_busy_fraction"] * s["wall_seconds"] / grads * 1e6}


def one_worker(size: str, tmp: Path) -> float:
    summary = tmp / "one.json"
    cmd = [sys.executable, "-m", "mpitrain", *SIZES[size], *DATA, "--steps", "3000", "--no-progress",
           "--summary-json", str(summary)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env(), timeout=600)
    return json.loads(summary.read_text())["steps_per_second"]


def against(a, tmp: Path) -> list[str]:
    """Interleaved A/B: each round runs this checkout (A) and `a.against` (B) back to back."""
    here = str(Path(__file__).resolve().parent.parent)
    rows = []
    for size in a.sizes.split(","):
        for k in [int(k) for k in a.workers.split(",")]:
            pairs = []
            for _ in range(a.rounds):
                pairs.append((served(k, size, a.steps, tmp, here), served(k, size, a.steps, tmp, a.against)))
            speed = statistics.median(x["per_s"] / y["per_s"] for x, y in pairs)
            cpu = statistics.median(x["server_us"] / y["server_us"] for x, y in pairs)
            a_us = statistics.median(x["server_us"] for x, _ in pairs)
            b_us = statistics.median(y["server_us"] for _, y in pairs)
            row = (f"| {size} | {k} | {statistics.median(x['per_s'] for x, _ in pairs):,.0f} | "
                   f"{statistics.median(y['per_s'] for _, y in pairs):,.0f} | {speed:.2f}x | {a_us:.0f} | {b_us:.0f} | "
                   f"{cpu:.2f}x |")
            print(row, flush=True)
            rows.append(row)
    return ["| model | fake workers | gradients/s A | B | A/B | rank 0 us per gradient A | B | A/B |",
            "|---|---|---|---|---|---|---|---|"] + rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="mlp,softmax")
    p.add_argument("--against", default=None, help="another checkout: an interleaved A/B against it")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ks = [int(k) for k in a.workers.split(",")]
    lines = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        if a.against:
            print("\n".join(against(a, tmp)))
            return 0
        for size in a.sizes.split(","):
            lim = limit_us(PARAMS[size])
            one = statistics.median(one_worker(size, tmp) for _ in range(a.rounds))
            for k in ks:
                runs = [served(k, size, a.steps, tmp) for _ in range(a.rounds)]
                per_s = statistics.median(r["per_s"] for r in runs)
                us = statistics.median(r["server_us"] for r in runs)
                capacity = 1e6 / us  # gradients/s with a core of its own
                row = (f"| {size} | {k} | {k + 1} on {os.cpu_count()} | {per_s:,.0f} | {us:.0f} | {lim:.0f} | "
                       f"{us / lim:.1f}x | {one:,.0f} | {per_s / one:.1f} | {capacity:,.0f} | {capacity / one:.1f} |")
                print(row, flush=True)
                lines.append(row)
    head = ["| model | fake workers | ranks on cores | gradients/s served | rank 0 CPU us per gradient | "
            "limit us (copy + apply + copy) | over the limit | one worker's steps/s | workers fed | "
            "gradients/s with a core of its own (1e6 / us) | workers it could feed |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    text = "\n".join(head + lines)
    if a.out:
        cmd = "python benchmarks/server.py " + " ".join(sys.argv[1:])
        record(a.out, f"# Server saturation (benchmarks/server.py)\n\n`{cmd}` on {machine()}; medians of {a.rounds} "
                      f"rounds.\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
