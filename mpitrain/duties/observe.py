"""What every rank is doing, for the user who asks "which rank is slow?" and "why is it stuck?".

- `Activity`: each rank's current phase (compute, push, pull, wait, allreduce, apply, eval,
  checkpoint), the seconds it spent in each, and its step-time samples. Its heartbeat thread sends
  a snapshot to its peers (liveness.py, protocol.BEAT_*), so rank 0 knows at any moment where
  each worker is, how fast it goes, and whether it is alive.
- Attribution (`attribute`): each worker's median step time and its ratio to the median of all
  workers; the ones above --straggler-report are named.
- Stall reports (`ServerStall`, `WorkerStall`): one line when training makes no progress for
  --stall-warning seconds, naming what is waited for and who has not arrived, alive or silent.
- Timeline (`Timeline`, `write_trace`): --timeline PATH, a Chrome/Perfetto trace of every rank's
  phases, bounded to the first and last --timeline-steps steps of each rank.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from mpitrain.core.atomic import write_atomic
from mpitrain.core.console import say
from mpitrain.exchange.protocol import (BEAT_COMPUTE, BEAT_FIELDS, BEAT_GLOBAL_STEP, BEAT_PHASE, BEAT_PHASE_S,
                                        BEAT_STEP_S, BEAT_STEPS, BEAT_WAIT)

# Phases, by code (the code travels in heartbeats). IDLE is set-up and the end of the run.
PHASES = ("idle", "compute", "push", "pull", "wait", "allreduce", "apply", "eval", "checkpoint")
IDLE, COMPUTE, PUSH, PULL, WAIT, ALLREDUCE, APPLY, EVAL, CHECKPOINT = range(len(PHASES))
WAITING = (PULL, WAIT, ALLREDUCE)  # time spent on peers, not on this rank's own work
SAMPLE_S = 0.5  # a step-time sample is the mean over this much wall time: a burst of stops shows
MAX_SAMPLES = 20000  # ~3 hours of samples; older ones drop out of the median
THREAD_MAIN, THREAD_HELPER = 0, 1  # timeline tracks within a rank (--quorum's gradient thread)


class Timeline:
    """--timeline: this rank's spans, bounded: every span of its first `keep` steps, then a ring of
    about its last `keep` steps' spans (SPANS_PER_STEP each), so a long run writes a bounded file:
    at most 2 x keep x SPANS_PER_STEP spans per rank."""

    SPANS_PER_STEP = 8

    def __init__(self, keep: int):
        self.keep = keep
        self.head: list[tuple] = []
        self.tail: deque = deque(maxlen=keep * self.SPANS_PER_STEP)
        self.wall0 = time.time() - time.perf_counter()  # perf_counter -> wall clock, shared by ranks
        self._lock = threading.Lock()  # --quorum: two threads record

    def span(self, phase: int, t0: float, t1: float, step: int, own_step: int, tid: int = THREAD_MAIN) -> None:
        record = (phase, t0, t1, step, tid)
        with self._lock:
            head = own_step < self.keep and len(self.head) < self.tail.maxlen  # (rank 0 in sync counts no steps)
            (self.head if head else self.tail).append(record)

    def events(self, rank: int) -> list[dict]:
        """Trace-event-format "complete" events (microseconds, wall clock)."""
        with self._lock:
            spans = self.head + list(self.tail)
        return [{"name": PHASES[p], "ph": "X", "pid": rank, "tid": tid, "ts": round((self.wall0 + t0) * 1e6, 1),
                 "dur": round((t1 - t0) * 1e6, 1), "args": {"global_step": step}} for p, t0, t1, step, tid in spans]


class Activity:
    """One rank's phases and step times. The training thread calls `enter` at every change of
    phase and `stepped` after every gradient it computes; the heartbeat thread reads `snapshot`.
    Cost: one clock read and a few attribute updates per call (0.43 us a step, timeline off)."""

    def __init__(self, timeline_steps: int = 0, clock=time.perf_counter):
        self.clock = clock
        now = clock()
        self.started = self.since = self._window_t = now
        self.phase, self.step = IDLE, 0  # the phase now, and the global step it works on
        self.seconds = [0.0] * len(PHASES)
        self.helper_compute_s = 0.0  # --quorum: computed by the gradient thread, beside the main one
        self.gradients = 0  # gradients this rank computed (its worker steps)
        self.bytes_sent = self.bytes_received = 0  # what this worker handed MPI to move, and got back
        self.exchanges = 0  # the exchanges it sent its work in: a push, an Allreduce, a --quorum push or update
        self.samples: deque = deque(maxlen=MAX_SAMPLES)  # busy seconds per gradient, one per SAMPLE_S
        self._window = (0.0, 0)  # busy seconds and gradients at the window's start
        self.timeline = Timeline(timeline_steps) if timeline_steps > 0 else None

    def enter(self, phase: int, step: int | None = None) -> None:
        now = self.clock()
        spent = now - self.since
        self.seconds[self.phase] += spent
        if self.timeline is not None and self.phase != IDLE:
            self.timeline.span(self.phase, self.since, now, self.step, self.gradients)
        self.phase, self.since = phase, now
        if step is not None:
            self.step = step

    def moved(self, sent: int = 0, received: int = 0) -> None:
        """Message bytes of one exchange: an async push (sent) or reply (received), a sync Allreduce's
        buffer (both: every worker contributes it and gets the sum), a --quorum push and update."""
        self.bytes_sent += sent
        self.bytes_received += received
        self.exchanges += bool(sent)

    def helper_computed(self, t0: float, t1: float, step: int) -> None:
        """--quorum: the gradient thread computed one gradient from t0 to t1."""
        self.helper_compute_s += t1 - t0
        if self.timeline is not None:
            self.timeline.span(COMPUTE, t0, t1, step, self.gradients, THREAD_HELPER)
        self.stepped()

    def busy_s(self, now: float) -> float:
        """The time behind this rank's gradients so far: wall time less the time in collectives.
        Per gradient, that is the interval at which rank 0 receives this worker's gradients
        (async) or the coordinator its pushes (--quorum), whatever slows it (computing, a stopped
        process, a slow link); in a sync Allreduce every worker waits for the slowest, so that
        wait is left out and what remains is the worker's own compute and update."""
        in_collective = self.seconds[ALLREDUCE] + (now - self.since if self.phase == ALLREDUCE else 0.0)
        return (now - self.started) - in_collective

    def stepped(self) -> None:
        self.gradients += 1
        now = self.clock()
        if now - self._window_t >= SAMPLE_S:
            busy = self.busy_s(now)
            b0, g0 = self._window
            self.samples.append((busy - b0) / (self.gradients - g0))
            self._window, self._window_t = (busy, self.gradients), now

    def median_step_s(self) -> float:
        """Median of the step-time samples; before the first full window, the run's mean."""
        samples = sorted(self.samples)
        if samples:
            return samples[len(samples) // 2]
        return self.busy_s(self.clock()) / self.gradients if self.gradients else float("nan")

    def shares(self) -> tuple[float, float]:
        """(compute, wait) as fractions of this rank's wall time so far."""
        now = self.clock()
        wall = max(now - self.started, 1e-9)
        current = now - self.since
        compute = self.seconds[COMPUTE] + self.helper_compute_s + (current if self.phase == COMPUTE else 0.0)
        wait = sum(self.seconds[p] for p in WAITING) + (current if self.phase in WAITING else 0.0)
        return compute / wall, wait / wall

    def times(self) -> dict:
        """Wall, compute and waiting seconds of the run so far (a worker's time_breakdown)."""
        wall = self.clock() - self.started
        compute, wait = self.shares()
        return {"wall_s": wall, "compute_s": compute * wall, "wait_s": wait * wall}

    def snapshot(self) -> list[float]:
        """What a heartbeat carries (protocol.BEAT_*; read back by step_time_from_beat, peer_state)."""
        beat = [0.0] * BEAT_FIELDS
        beat[BEAT_COMPUTE], beat[BEAT_WAIT] = self.shares()
        beat[BEAT_STEPS], beat[BEAT_PHASE], beat[BEAT_GLOBAL_STEP] = self.gradients, self.phase, self.step
        beat[BEAT_PHASE_S] = self.clock() - self.since
        beat[BEAT_STEP_S] = self.median_step_s()
        return beat

    def report(self) -> dict:
        """The end-of-run step time, in a worker's report: also the compute seconds per gradient and
        the number of step-time samples, which attribute() needs before it names a worker slow."""
        compute, wait = self.shares()
        wall = self.clock() - self.started
        return {"median_s": self.median_step_s(), "compute": compute, "wait": wait, "gradients": self.gradients,
                "compute_s": compute * wall / self.gradients if self.gradients else float("nan"),
                "samples": len(self.samples)}


def step_time_from_beat(beat: list[float]) -> dict:
    """A heartbeat's step time, in the shape of Activity.report (what `attribute` reads)."""
    return {"median_s": beat[BEAT_STEP_S], "compute": beat[BEAT_COMPUTE], "wait": beat[BEAT_WAIT]}


# A worker is named slow only on a median of at least this many step-time samples (SAMPLE_S each,
# so 2.5 s of its training): one window can hold a start-up hiccup or a scheduler slice given to
# another rank on an oversubscribed node (measured: "1.9x" on 5 of ~25 sub-second runs of a busy
# 2-core VM, every worker healthy), and a median of five outvotes two such windows.
MIN_SLOW_SAMPLES = 5


def _ratio_to_others(times: dict[int, dict], rank: int, key: str) -> float:
    """times[rank][key] over the median of the other workers' (nan when there is nothing to compare).
    The others, not all: with two workers the median of all is their mean, and a worker 5x slower
    than its peer would read as 1.7x."""
    mine = times[rank].get(key, float("nan"))
    others = [u[key] for r, u in times.items() if r != rank and finite(u.get(key, float("nan")))]
    typical = statistics.median(others) if others else 0.0
    return mine / typical if typical > 0 and finite(mine) else float("nan")


def attribute(times: dict[int, dict], threshold: float) -> tuple[list[dict], list[dict]]:
    """(every worker's step time with its ratio to the median of the other workers, the workers
    named slow); `times` maps rank -> Activity.report() (or a heartbeat's step_time_from_beat).

    A worker is named only when it is slow in its own work, not in waiting: its step time AND its
    compute seconds per gradient are both at least `threshold` times the others' (an async worker
    whose replies come late has a long step but an ordinary compute time: it waits, the server or
    the node is what is slow), and only on at least MIN_SLOW_SAMPLES samples."""
    rows = []
    for rank in sorted(times):
        t = times[rank]
        rows.append({"rank": rank, "median_s": t["median_s"], "ratio": _ratio_to_others(times, rank, "median_s"),
                     "compute_ratio": _ratio_to_others(times, rank, "compute_s"), "compute": t["compute"],
                     "wait": t["wait"]})
    slow = [r for r in rows if threshold > 0 and r["ratio"] >= threshold and r["compute_ratio"] >= threshold
            and times[r["rank"]].get("samples", 0) >= MIN_SLOW_SAMPLES]
    return rows, sorted(slow, key=lambda r: -r["ratio"])


def slow_line(row: dict) -> str:
    return (f"rank {row['rank']} is {row['ratio']:.1f}x the other workers' median step time "
            f"({row['median_s'] * 1e3:.2f} ms; its compute {row['compute_ratio']:.1f}x theirs; "
            f"compute {100 * row['compute']:.0f}%, wait {100 * row['wait']:.0f}%)")


def write_trace(path: str, events: list[dict], names: dict[int, str]) -> None:
    """One trace-event JSON file, times from the earliest span (chrome://tracing, ui.perfetto.dev)."""
    import json

    t0 = min((e["ts"] for e in events), default=0.0)
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}} for rank, name in names.items()]
    meta += [{"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}} for rank in names]
    body = [{**e, "ts": round(e["ts"] - t0, 1)} for e in events]

    def write(f) -> None:
        json.dump({"traceEvents": meta + body, "displayTimeUnit": "ms"}, f)

    write_atomic(Path(path), write)


# -- stall reports ------------------------------------------------------------------------------

def _ago(seconds: float) -> str:
    return f"{seconds:.1f} s"


def peer_state(rank: int, beat: list[float] | None, heard_s: float, beat_age_s: float, silent_after: float,
               timeout: float) -> str:
    """How a peer looks from here: silent (no heartbeat for `silent_after` s), or alive, and in
    which phase for how long (its last beat said so `beat_age_s` ago)."""
    if beat is None or heard_s > silent_after:
        lost = f"declared lost after --worker-timeout {timeout:g} s" if timeout > 0 else "--worker-timeout 0 never declares it lost"
        return f"rank {rank} silent for {_ago(heard_s)} (no heartbeat: stopped, frozen or dead; {lost})"
    phase = PHASES[int(beat[BEAT_PHASE])]
    in_phase = beat[BEAT_PHASE_S] + beat_age_s
    state = "waiting" if int(beat[BEAT_PHASE]) in WAITING else "alive, not progressing"
    where = (f"at global step {int(beat[BEAT_GLOBAL_STEP]):,}" if rank == 0  # rank 0 computes no gradients
             else f"{int(beat[BEAT_STEPS]):,} gradients computed")
    return f"rank {rank} last heard {_ago(heard_s)} ago, {where}, in {phase} for {_ago(in_phase)} ({state})"


class Stall:
    """Once per stall: `check(now)` says `describe(stalled_s)` when `marker()` has not moved for
    `after_s` seconds, and says nothing more until it moves again (then one line: resumed)."""

    def __init__(self, after_s: float, marker, describe, clock=time.monotonic, stream=None):
        self.after_s, self.marker, self.describe, self.clock = after_s, marker, describe, clock
        self.stream = stream
        self.last = marker()
        self.since = clock()
        self.reported = self.said = False
        self.reports = 0

    def check(self) -> None:
        now = self.clock()
        if self._resumed(now):
            return
        if not self.reported and now - self.since >= self.after_s:
            try:
                line = self.describe(now - self.since)  # None: another rank says it
            except Exception as e:  # a diagnostic must never end the run it diagnoses
                line = f"mpitrain: no progress for {now - self.since:.0f} s (the stall report failed: {e!r})"
            self.reported, self.said = True, bool(line)
            if line:
                self.reports += 1
                say(line, self.stream or sys.stderr)

    def finish(self) -> None:
        """The loop ended: a stall it reported and then got past is said to be over, even when the
        last steps ran between two checks (a stall near the end of the budget)."""
        self._resumed(self.clock())

    def _resumed(self, now: float) -> bool:
        mark = self.marker()
        if mark == self.last:
            return False
        if self.reported and self.said:
            say(f"mpitrain: training resumed after {now - self.since:.1f} s without progress", self.stream or sys.stderr)
        self.last, self.since, self.reported, self.said = mark, now, False, False
        return True




def describe_server_stall(what: str, step: int, stalled_s: float, peers: list[str], culprits: list[int]) -> str:
    who = f" (not arrived: rank {', '.join(map(str, culprits))})" if culprits else ""
    return (f"mpitrain: stalled at global step {step:,}: no progress for {stalled_s:.0f} s (--stall-warning), "
            f"{what}{who}; " + "; ".join(peers))


def not_arrived(seen: dict[int, tuple], silent_after: float) -> list[int]:
    """The workers the others wait for: silent, or alive but not in a waiting phase. `seen` maps
    rank -> (last beat or None, seconds since heard, seconds since that beat), as Watch.seen."""
    out = []
    for rank, (beat, heard_s, _) in sorted(seen.items()):
        if beat is None or heard_s > silent_after or int(beat[BEAT_PHASE]) not in WAITING:
            out.append(rank)
    return out


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
