"""Flakes found before CI finds them: the fault tests rerun many times beside a CPU burner (issue 82).

    python benchmarks/soak_tests.py [--rounds 20] [--burners 1] [--files tests/test_startup.py ...]
                                    [--out benchmarks/SOAK.md]

Each round runs pytest once over the fault tests (kills, joins, respawns, take-overs, spares, start-up and
shutdown kills, kills in the shm store) under the MPI of this install's mpirun, while --burners processes spin on the machine's cores
as a loaded cluster node's neighbours do; a second install (the Open MPI venv's python) soaks under the other
MPI. Reported per test: runs, passes, skips, failures, and the first line of each failure. A test that fails
once here is fixed at its cause, never retried (the watchdog's rerun rule aside: tests/conftest.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import machine, mpirun  # noqa: E402

from support import mpiimpl  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)

ROOT = Path(__file__).resolve().parent.parent
FAULT_TESTS = ["tests/test_startup.py", "tests/test_lost_workers.py", "tests/test_respawn.py", "tests/test_spares.py",
               "tests/test_failover.py", "tests/test_join.py", "tests/test_elastic.py", "tests/test_chaos.py",
               "tests/test_serving.py", "tests/test_observe.py",  # observe: stalls are timed, as kills are
               "tests/test_slurm.py",  # kills and stops through srun: a task killed mid-training, a USR1 requeue
               "tests/test_shm.py"]  # a worker killed in the store, at each point of its push


def burn() -> None:
    while True:
        pass


def one_round(files: list[str], xml: Path, keep: Path | None = None) -> dict[str, tuple[str, str]]:
    """pytest over `files` once: test id -> (outcome, the first line of its failure). `keep`: a folder that gets
    each failure's whole text (the assertion, its output, the traceback), one file a failure: a first line is
    rarely enough to find a cause (soak of 2026-12-07: a job's exit code, the message its standard output)."""
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files],
                   cwd=ROOT, capture_output=True, text=True)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            outcomes[name] = ("failed", (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else "")
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                path = keep / f"{xml.stem}-{''.join(c if c.isalnum() else '_' for c in name)[:150]}.txt"
                path.write_text(f"{name}\n{bad.get('message') or ''}\n\n{bad.text or ''}")
        elif case.find("skipped") is not None:
            outcomes[name] = ("skipped", "")
        else:
            outcomes[name] = ("passed", "")
    return outcomes


def tree_state() -> tuple[str, str]:
    """The tree the rounds run (ROOT): its commit, and its uncommitted changes to tracked files. Soak a clone, not
    the tree being edited: each round runs whatever the files hold then (2026-12-08: a soak of the working tree
    while a module was split failed 6 tests on the half-edited imports)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--burners", type=int, default=1)
    p.add_argument("--files", nargs="*", default=FAULT_TESTS)
    p.add_argument("--out", default=None)
    p.add_argument("--keep", default=None, help="a folder for each failure's whole text (default: none kept)")
    a = p.parse_args()
    impl = mpiimpl.of_mpirun(mpirun())
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(a.burners)]
    for b in burners:
        b.start()
    seen: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    why: dict[str, list[str]] = defaultdict(list)
    t0, rounds, changed = time.monotonic(), 0, []
    start = tree_state()
    if start[1]:
        print("warning: the tree has uncommitted changes (soak a clone of a commit)", flush=True)
    signal.signal(signal.SIGTERM, _interrupted)  # `kill`, `timeout`: as Ctrl-C
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                keep = Path(a.keep) if a.keep else None
                for name, (outcome, line) in one_round(a.files, Path(tmp) / f"r{r + 1}.xml", keep).items():
                    seen[name][outcome] += 1
                    if outcome == "failed":
                        why[name].append(f"round {r + 1}: {line}")
                failed = sum(1 for v in seen.values() if v["failed"])
                rounds = r + 1
                if tree_state() != start:
                    changed.append(rounds)
                print(f"[{r + 1}/{a.rounds}] {time.monotonic() - t0:.0f} s, {failed} test(s) failed so far", flush=True)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the rounds done are still worth their results file
        print(f"interrupted: the results of the {rounds} whole round(s) done", flush=True)
    finally:
        for b in burners:
            b.terminate()
    minutes = (time.monotonic() - t0) / 60
    clean = [n for n, v in seen.items() if not v["failed"]]
    lines = [f"# Fault tests soaked, {impl.title}", "",
             f"`python benchmarks/soak_tests.py --rounds {a.rounds} --burners {a.burners}`"
             f"{f' (interrupted after {rounds})' if rounds < a.rounds else ''} at {start[0]}"
             f"{' with uncommitted changes' if start[1] else ''}"
             f"{f' (the tree changed by round(s) {changed}: their results mix versions)' if changed else ''} over "
             f"{', '.join(f'`{f}`' for f in a.files)}; {machine()}; {minutes:.0f} min.", "",
             f"**{len(clean)} of {len(seen)} tests never failed** in {rounds} rounds beside {a.burners} spinning "
             f"process(es).", "", "| test | runs | passed | skipped | failed | first failures |",
             "|---|---|---|---|---|---|"]
    for name in sorted(seen, key=lambda n: (-seen[n]["failed"], n)):  # the failures first
        v = seen[name]
        runs = v["passed"] + v["skipped"] + v["failed"]
        lines.append(f"| `{name}` | {runs} | {v['passed']} | {v['skipped']} | {v['failed']} | "
                     f"{'; '.join(why[name][:2]).replace('|', '/')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        record(a.out, text)
    return 0 if len(clean) == len(seen) else 1


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
