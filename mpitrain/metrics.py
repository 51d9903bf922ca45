"""What rank 0 shows: the start lines, the tqdm bar, the human summary and the JSON summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpitrain.atomic import write_atomic


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
            self._last_post = time.perf_counter()  # first postfix after 0.25 s, with a meaningful rate

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


class RunLog:
    """--log-dir on rank 0: events.jsonl (one JSON object a line) and, when tensorboardX is
    installed, TensorBoard event files with the same scalars (`tensorboard --logdir DIR`)."""

    def __init__(self, log_dir: str, start: dict, every: int):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.jsonl = open(self.dir / "events.jsonl", "a", buffering=1)  # a line at a time: readable while it runs
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.dir))
            self.tb.add_scalar("run/start_step", start.get("start_step", 0), start.get("start_step", 0))
            self.tb.flush()  # the first write is slow (lazy set-up): not inside training time
        except ImportError:
            self.tb = None
            say("mpitrain: --log-dir: tensorboardX is not installed, writing events.jsonl only "
                "(pip install 'mpitrain[tensorboard]')", sys.stderr)
        self.t0 = time.time()  # after the (slow) tensorboardX import: seconds count training time
        self._write({"event": "start", **start})

    def _write(self, obj: dict) -> None:
        obj = {"time": time.time(), "seconds": time.time() - self.t0, **obj}
        self.jsonl.write(json.dumps(obj, default=float) + "\n")

    def _scalars(self, step: int, prefix: str, values: dict) -> None:
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value == value:
                    self.tb.add_scalar(f"{prefix}/{key}", value, step)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def train(self, step: int, force: bool = False, **values) -> None:
        """Training scalars at global `step` (every --log-every steps unless forced)."""
        if force or self.due(step):
            self._write({"event": "train", "global_step": step, **values})
            self._scalars(step, "train", {k: v for k, v in values.items() if not isinstance(v, (list, dict))})

    def workers(self, step: int, rows: list[dict]) -> None:
        """Each worker's median step time and its ratio to the other workers' median (observe.attribute)."""
        self._write({"event": "workers", "global_step": step, "worker_step_seconds": rows})
        for row in rows:
            self._scalars(step, f"workers/rank_{row['rank']}", {"step_seconds": row["median_s"],
                                                                "step_time_ratio": row["ratio"]})

    def event(self, name: str, **fields) -> None:
        """A one-off event (e.g. worker_lost), in events.jsonl only."""
        self._write({"event": name, **fields})

    def eval(self, entry: dict) -> None:
        self._write({"event": "eval", **entry})
        self._scalars(entry["global_step"], "eval", {k: v for k, v in entry.items() if k != "global_step"})

    def close(self, summary: dict) -> None:
        keep = ("global_step", "test_accuracy", "test_loss", "ema_test_accuracy", "samples_per_second", "wall_seconds")
        self._write({"event": "end", **{k: summary.get(k) for k in keep}})
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def write_json_atomic(path: str, obj: dict) -> None:
    """Never a half-written summary: temporary file, then os.replace."""
    def write(f) -> None:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")

    write_atomic(Path(path), write)


def staleness_summary(counts: dict) -> dict:
    """mean, p50, p99, max of applied gradients' staleness, from a {staleness: count} histogram."""
    total = sum(counts.values())
    if not total:
        return {"mean": 0.0, "p50": 0, "p99": 0, "max": 0, "gradients": 0}
    values = sorted(counts)

    def quantile(q: float) -> int:
        seen = 0
        for v in values:
            seen += counts[v]
            if seen >= q * total:
                return int(v)
        return int(values[-1])

    mean = sum(v * c for v, c in counts.items()) / total
    return {"mean": mean, "p50": quantile(0.5), "p99": quantile(0.99), "max": int(values[-1]), "gradients": total}


def straggler_line(s: dict) -> str | None:
    """One line on what slow workers did to the run, when there were any (or drops)."""
    slow = ", ".join(f"rank {r} ({'x' + format(v, 'g') if k == 'factor' else format(v, 'g') + ' s/step'})"
                     for r, k, v in s["config"]["stragglers"])
    if not slow and not s["dropped_gradients"]:
        return None
    who = slow or "no injected straggler"
    rate = f"{s['steps_per_second']:,.1f} global steps/s"
    if s["mode"] == "async":
        shares = [f"{100 * k / max(1, s['global_step']):.0f}%" for k in s["local_steps"]]
        st = s["staleness"]
        bound = s["config"]["max_staleness"]
        waited = "nobody waited" if bound is None else f"replies held back to keep staleness <= {bound}"
        return (f"  straggler effect: {who}; {waited} ({rate}); workers' shares of the updates "
                f"[{', '.join(shares)}]; staleness mean {st['mean']:.1f}, max {st['max']}")
    if s["quorum"] is None or s["quorum"] == s["workers"]:
        return f"  straggler effect: {who}; sync without --quorum waits for the slowest every step ({rate})"
    per = s["dropped_gradients_per_worker"]
    return (f"  straggler effect: {who}; quorum {s['quorum']} of {s['workers']} went on without it ({rate}); "
            f"{s['dropped_gradients']} late gradients dropped, per worker {per}")


def human_summary(s: dict) -> list[str]:
    ranks = "1 process, local" if s["world_size"] == 1 else f"{s['world_size']} ranks: {s['num_ps']} PS + {s['workers']} workers"
    workers_acc = ", ".join(f"{a:.4f}" for a in s["worker_test_accuracy"])
    return [
        f"mpitrain {'stopped (diverged)' if s.get('diverged') else 'done'}: {s['mode']} | {s['model_description']} | "
        f"{s['dataset']} | {ranks}",
        f"  global step {s['global_step']:,} | local steps {s['local_steps']} | {s['wall_seconds']:.2f} s training"
        f" | {s['samples_per_second']:,.0f} samples/s",
        f"  test accuracy {s['test_accuracy']:.4f} (rank 0)"
        + (f", EMA {s['ema_test_accuracy']:.4f}" if s.get("ema_test_accuracy") is not None else "")
        + f" | per worker [{workers_acc}] | test loss "
        f"{s['test_loss']:.4f} | final train loss {s['final_loss']:.4f} | dropped gradients {s['dropped_gradients']}",
    ] + ([line] if (line := straggler_line(s)) else []) + slow_lines(s) + lost_lines(s)


def slow_lines(s: dict) -> list[str]:
    """Measured, whatever the cause (--straggler-report): observe.attribute's slow workers."""
    from mpitrain.observe import slow_line

    return [f"  slow worker: {slow_line(row)}" for row in s.get("slow_workers") or []]


def lost_lines(s: dict) -> list[str]:
    return [f"  lost worker rank {x['rank']} at global step {x['global_step']:,} ({x['reason']})"
            for x in s.get("lost_workers") or []]
