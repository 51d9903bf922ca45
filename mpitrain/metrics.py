"""What rank 0 shows: the start lines, the tqdm bar, the human summary and the JSON summary."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def say(line: str, stream=None) -> None:
    """One line in one write: mpirun interleaves ranks' output at write boundaries."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


class Progress:
    """tqdm bar on stderr (rank 0 only): global step, loss, samples/s. Inactive with --no-progress."""

    def __init__(self, enabled: bool, total: int | None, global_batch: int):
        self.global_batch = global_batch
        self.bar = None
        self.t0 = time.perf_counter()
        self.step = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", desc="global step", file=sys.stderr,
                            mininterval=0.25, dynamic_ncols=True, leave=True)
            self._last_post = 0.0

    def update(self, step: int, loss: float) -> None:
        if self.bar is None:
            self.step = step
            return
        if self.step == 0:
            self.t0 = time.perf_counter()  # rate from the first step on, not from set-up
        self.bar.update(step - self.step)
        self.step = step
        self.loss = loss
        now = time.perf_counter()
        if now - self._last_post >= 0.25:  # set_postfix formats strings: keep it off every step
            self._postfix(now)

    def _postfix(self, now: float) -> None:
        rate = self.step * self.global_batch / max(now - self.t0, 1e-9)
        self.bar.set_postfix_str(f"loss={self.loss:.4f} samples/s={rate:,.0f}", refresh=False)
        self._last_post = now

    def close(self) -> None:
        if self.bar is not None:
            if self.step:
                self._postfix(time.perf_counter())
            self.bar.close()


def write_json_atomic(path: str, obj: dict) -> None:
    """Write to a temporary file beside `path`, then os.replace: never a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def human_summary(s: dict) -> list[str]:
    ranks = "1 process, local" if s["world_size"] == 1 else f"{s['world_size']} ranks: 1 PS + {s['workers']} workers"
    workers_acc = ", ".join(f"{a:.4f}" for a in s["worker_test_accuracy"])
    return [
        f"mpitrain done: {s['mode']} | {s['model_description']} | {s['dataset']} | {ranks}",
        f"  global step {s['global_step']:,} | local steps {s['local_steps']} | {s['wall_seconds']:.2f} s training"
        f" | {s['samples_per_second']:,.0f} samples/s",
        f"  test accuracy {s['test_accuracy']:.4f} (rank 0) | per worker [{workers_acc}] | test loss "
        f"{s['test_loss']:.4f} | final train loss {s['final_loss']:.4f} | dropped gradients {s['dropped_gradients']}",
    ]
