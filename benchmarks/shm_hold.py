"""How long one push holds the shm store's lock: NumPy's update against the one-pass BLAS one.

    python benchmarks/shm_hold.py                 # writes benchmarks/SHM_HOLD.md (~1 min)

With --ps-transport shm every worker of the host applies its gradient and copies the parameters
out under shard 0's lock, so the lock's hold is the store's serial cost: at W workers per host
the job makes at most 1 / hold pushes per second whatever W (issue 47's 16-core goal). One
process, no contention: the lock taken and released, the step's checks, the optimizer's apply
(`SharedUpdate.apply`), the ring entry and the copy-out, as `ShmPushPull._apply` does them; the
median of --repeats timings of --number pushes each. "numpy" is the optimizer's NumPy step (the
message path's, and the store's before 2026-11-29), "blas" the store's now (`optim.axpy`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support import REGISTRY, SharedUpdate, StalenessHold, TrainState, parse_args, shm  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)

SIZES = {"mlp 784-200-10": 784 * 200 + 200 + 200 * 10 + 10, "softmax 784-10": 784 * 10 + 10}


def hold_us(n: int, optimizer: str, update: str, number: int, repeats: int) -> float:
    cfg, _ = parse_args(["--optimizer", optimizer])
    names = REGISTRY[optimizer].state
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=shm.SHM_DIR) as tmp:
        store = shm.Store(os.path.join(tmp, "seg"), n, 2, names, ema=False, dc=False, create=True)
        store.fill(TrainState(rng.standard_normal(n).astype(np.float32), 0), 2, hold_at=2**62)
        shared = SharedUpdate(cfg, store, np)
        if update == "numpy":
            shared.update.opt._step = REGISTRY[optimizer].step
        grad, pulled, hold = rng.standard_normal(n).astype(np.float32) * 1e-6, np.empty(n, np.float32), StalenessHold(None)

        def push():
            with store.locked():
                v = int(store.header[shm.VERSION])
                store.may_step(v, 0, hold)
                shared.apply(grad, 1e-3, 0, v, pulled)
                store.stepped(v, 0.5, v, 0)
                pulled[:] = store.params

        times = timeit.repeat(push, number=number, repeat=repeats)
        store.close()
    return statistics.median(times) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=300)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "SHM_HOLD.md"))
    a = p.parse_args()
    rows = []
    for label, n in SIZES.items():
        for optimizer in ("sgd", "momentum"):
            runs = {"numpy": [], "blas": []}
            for _ in range(3):  # interleaved, the least disturbed of three kept: this VM's speed drifts
                for u, times in runs.items():
                    times.append(hold_us(n, optimizer, u, a.number, a.repeats))
            us = {u: min(times) for u, times in runs.items()}
            rows.append(f"| {label} | {optimizer} | {us['numpy']:.1f} | {us['blas']:.1f} | {us['numpy'] / us['blas']:.2f}x |")
    text = "\n".join([
        "# The shm store's lock: how long one push holds it", "",
        f"`python benchmarks/shm_hold.py`, {machine()}; one process, the least of 3 medians of {a.repeats} x {a.number} pushes "
        "(see the script's docstring). Adam has no one-pass step: its apply is NumPy's either way.", "",
        "| model | optimizer | hold, NumPy update (us) | hold, BLAS update (us) | ratio |",
        "|---|---|---|---|---|", *rows, ""])
    record(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
