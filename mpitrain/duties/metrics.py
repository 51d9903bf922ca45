"""What rank 0 shows: the start lines, the tqdm bar, the human summary and the JSON summary."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from pathlib import Path

from mpitrain.core.atomic import set_aside, write_atomic
from mpitrain.core.console import say
from mpitrain.duties.observe import slow_line
from mpitrain.duties.outputs import WRITES


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


class JobOutputs:
    """Rank 0's progress bar and --log-dir, made by the job's first phase and handed on through
    the phases a join or a respawn starts (join.Carry; Context.outputs), so that one bar and one
    series of events go on over the whole job: a join re-forms the world, not the run."""

    def __init__(self):
        self.progress: Progress | None = None
        self.log: RunLog | None = None

    def close_bar(self) -> None:
        """The job's end (or its failure): the bar's last line stays on the terminal."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None


def summary_writer_class():
    """tensorboardX's SummaryWriter (ImportError without it), imported without PyTorch: its writer
    imports torch whenever installed, only to accept torch tensors, which mpitrain never gives it
    (floats only), and that import took 3-5 s of rank 0's set-up on 2 cores (PyTorch 2.14, measured)
    while every worker waited. A torch the process already holds (a user's Model) stays as it is."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError until this entry goes
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class RunLog:
    """--log-dir on rank 0: events.jsonl (one JSON object a line) and, when tensorboardX is
    installed, TensorBoard event files with the same scalars (`tensorboard --logdir DIR`)."""

    def __init__(self, log_dir: str, start: dict, every: int):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.every = every
        start_step = start.get("start_step", 0)
        if not start_step:
            try:
                set_aside_log(self.dir)
            except OSError as e:
                WRITES.failed("log", "--log-dir: the earlier run's events moved aside", self.dir, e,
                              "this run's events follow theirs in events.jsonl")
        self.path = self.dir / "events.jsonl"
        # Unbuffered bytes: each line is one write, readable while the run goes on, and a write
        # that fails (a full disk) is cut back off, so no half line is left behind.
        self.jsonl = open(self.path, "ab", buffering=0)
        if ends_cut(self.path):  # a run killed mid-line: its half line stays a line of its own
            self._append(b"\n")
        try:
            SummaryWriter = summary_writer_class()
            # A resumed run rewrites the steps after its checkpoint: TensorBoard drops the earlier
            # run's events from that step on (purge_step), so no curve jumps back.
            self.tb = SummaryWriter(str(self.dir), purge_step=start_step or None)
            self.tb_failures = guard_tensorboard(self.tb)
            self.tb.add_scalar("run/start_step", start.get("start_step", 0), start.get("start_step", 0))
            self.tb.flush()  # the first write is slow (lazy set-up): not inside training time
        except ImportError:
            self.tb, self.tb_failures = None, []
            say("mpitrain: --log-dir: tensorboardX is not installed, writing events.jsonl only "
                "(pip install 'mpitrain[tensorboard]')", sys.stderr)
        except OSError as e:  # its event file could not be made (a full disk): events.jsonl goes on
            self.tb, self.tb_failures = None, []
            WRITES.failed("tensorboard", "TensorBoard events", self.dir, e,
                          "no TensorBoard file for this run; events.jsonl and training go on")
        self.last_train_step = -1
        self.t0 = time.time()  # after the (slow) tensorboardX import: seconds count training time
        self._write({"event": "start", **start})

    def _write(self, obj: dict) -> None:
        obj = {"time": time.time(), "seconds": time.time() - self.t0, **obj}
        self._append((to_json(obj) + "\n").encode())

    def _append(self, data: bytes) -> None:
        """One line onto events.jsonl; on a failed write (full disk, quota, I/O error, the folder
        removed) the file is cut back to where it was, the failure reported, and training goes on."""
        end = None
        try:
            end = self.jsonl.seek(0, os.SEEK_END)
            if self.jsonl.write(data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            WRITES.failed("log", "--log-dir event", self.path, e)
            if end is not None:
                try:
                    self.jsonl.truncate(end)
                except OSError:
                    pass

    def _scalars(self, step: int, prefix: str, values: dict) -> None:
        if self.tb is None:
            return
        if self.tb_failures:  # its writer failed: TensorBoard's file stops here, events.jsonl goes on
            WRITES.failed("tensorboard", "TensorBoard events", self.dir, self.tb_failures[0],
                          "TensorBoard's file stops here for this run; events.jsonl and training go on")
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and value == value:
                self.tb.add_scalar(f"{prefix}/{key}", value, step)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def train(self, step: int, force: bool = False, **values) -> None:
        """Training scalars at global `step` (every --log-every steps unless forced), once a step:
        the phase after a join starts at the step the one before it ended at (one series, no repeat)."""
        if step > self.last_train_step and (force or self.due(step)):
            self.last_train_step = step
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
            try:
                self.tb.close()
            except OSError as e:
                WRITES.failed("tensorboard", "TensorBoard event", self.dir, e)


def ends_cut(path: Path) -> bool:
    """Whether a log ends in half a line: its last byte alone is read, however long the log."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def guard_tensorboard(tb) -> list[OSError]:
    """tensorboardX writes on a thread of its own: a full disk there raises in that thread (a
    traceback), which dies, and the next scalars then wait forever on its full queue (measured:
    a run on a full 64 KiB tmpfs hung). Its file writer's write and flush are wrapped so that an
    OSError is kept (the list returned) and every later event dropped; RunLog reports it. Without
    those internals (another tensorboardX) nothing is wrapped."""
    failures: list[OSError] = []
    try:
        writer = tb._get_file_writer().event_writer._ev_writer
    except AttributeError:
        return failures

    def guarded(call):
        def run(*args, **kwargs):
            if failures:
                return None
            try:
                return call(*args, **kwargs)
            except OSError as e:
                failures.append(e)
                return None
        return run

    writer.write_event, writer.flush = guarded(writer.write_event), guarded(writer.flush)
    return failures


def set_aside_log(directory: Path) -> Path | None:
    """A new run (not a resumed one) in a --log-dir that holds an earlier run's events: those
    move to a superseded-* subfolder, so the plot and TensorBoard never join two runs into one
    line. Returns that folder, or None when there was nothing to move."""
    old = [p for p in directory.iterdir() if p.is_file() and
           (p.name == "events.jsonl" or p.name.startswith("events.out.tfevents."))]
    target = set_aside(old, directory)
    if target is not None:
        say(f"mpitrain: --log-dir: a new run; the earlier run's events moved to {target}")
    return target


def json_safe(obj):
    """`obj` with every non-finite float (NaN, Infinity) as None: JSON has no NaN, and
    JSON.parse, jq and many other readers reject the bare `NaN` Python's json module writes."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # NumPy scalars
        return json_safe(obj.item())
    return obj


def to_json(obj, **kwargs) -> str:
    """Strict JSON (null for NaN and Infinity)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def write_json_atomic(path: str, obj: dict) -> None:
    """Never a half-written summary: temporary file, then os.replace."""
    def write(f) -> None:
        f.write(to_json(obj, indent=2, sort_keys=True))
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
    if (not slow and not s["dropped_gradients"]) or s["steps_per_second"] is None:
        return None  # nobody slowed it down; or nothing was trained in this run (a phase that started at the budget)
    who = slow or "no injected straggler"
    rate = f"{s['steps_per_second']:,.1f} global steps/s"
    if s["mode"] == "async":
        shares = [f"{100 * k / max(1, s['global_step']):.0f}%" for k in s["worker_steps"]]
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
    ranks = "1 process" if s["world_size"] == 1 else f"{s['world_size']} ranks: {s['num_ps']} PS + {s['workers']} workers"
    workers_acc = ", ".join(f"{a:.4f}" for a in s["worker_test_accuracy"])
    status = ("stopped (diverged)" if s.get("diverged") else
              f"stopped ({s['stopped']['signal']})" if s.get("stopped") else "done")
    alone = s["world_size"] == 1  # one process: no workers to tell apart, nothing dropped
    if s.get("trained", True):
        outer = s["config"]["local_steps"] > 1 and not alone  # --local-steps: the exchanges the saving is in
        steps = ("" if alone else f" | worker steps {s['worker_steps']}") + (
            f" in {s['worker_exchanges']} exchanges{' since the resume' if s.get('resumed_from') else ''}"
            if outer else "") + (
            f" | {s['wall_seconds']:.2f} s training | {s['samples_per_second']:,.0f} samples/s")
        if s.get("bytes_per_sample") is not None:
            steps += f" | {s['bytes_per_sample']:,.0f} bytes through MPI per sample"
        if s.get("compute_utilisation") is not None:
            steps += f" | computing {s['compute_utilisation']:.0%} of the workers' time"
    elif s.get("failovers"):  # rank 0 was lost once the workers had finished: its successor saved and evaluated
        steps = ": rank 0 was lost after the workers reached the budget; the successor saved and evaluated it"
    else:
        steps = (f": the checkpoint it resumed from had reached the budget, so nothing was trained "
                 f"(evaluated only; {s['resumed_from']})")
    final = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    return [
        f"mpitrain {status}: {s['mode']} | {s['model_description']} | {s['dataset']} | {ranks}",
        f"  global step {s['global_step']:,}{steps}",
        f"  test accuracy {s['test_accuracy']:.4f}" + ("" if alone else " (rank 0)")
        + (f", EMA {s['ema_test_accuracy']:.4f}" if s.get("ema_test_accuracy") is not None else "")
        + ("" if alone else f" | per worker [{workers_acc}]") + f" | test loss {s['test_loss']:.4f} | final train "
        f"loss {final}" + ("" if alone else f" | dropped gradients {s['dropped_gradients']}"),
    ] + ([line] if (line := straggler_line(s)) else []) + slow_lines(s) + lost_lines(s) + epoch_lines(s) + (
        [summary_stop_line(s)] if s.get("stopped") else [])


def summary_stop_line(s: dict) -> str:
    """The one line a stopped run ends with (stdout, last line of the summary)."""
    st = s["stopped"]
    origin = f" (from {st['origin']})" if st.get("origin") else ""
    return f"mpitrain stopped ({st['signal']}) at global step {st['global_step']:,}{origin}; {st['resume']}"


def slow_lines(s: dict) -> list[str]:
    """Measured, whatever the cause (--straggler-report): observe.attribute's slow workers."""
    return [f"  slow worker: {slow_line(row)}" for row in s.get("slow_workers") or []]


def epoch_lines(s: dict) -> list[str]:
    """The last epoch dealt whole, when it did not train each of its samples once (core/ledger.epochs)."""
    whole = [e for e in s.get("epochs") or [] if e["complete"]]
    if not whole or not any(whole[-1][k] for k in ("missed", "repeated", "dropped", "partial")):
        return []
    e = whole[-1]
    why = [w for w, n in (("a resume deals the missed again", e["missed"]),
                          ("dropped: in a worker's batch that the quorum's update left out", e["dropped"]),
                          (f"{e['partial']:,} applied in part: on some servers' slices only", e["partial"])) if n]
    return [f"  epoch {e['epoch']}: {e['samples']:,} samples applied, {e['missed']:,} missed, {e['repeated']:,} repeated, "
            f"{e['dropped']:,} dropped" + (f" ({'; '.join(why)})" if why else "")]


def lost_lines(s: dict) -> list[str]:
    return [f"  lost worker rank {x['rank']} at global step {x['global_step']:,} ({x['reason']})"
            for x in s.get("lost_workers") or []]
