"""Helpers that launch mpitrain under mpirun in a subprocess, always with a timeout."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mpitrain.launch import mpiimpl

MPI_TIMEOUT_S = 120  # a deadlock fails the test instead of hanging CI


def pytest_configure(config):
    """The suite starts Python processes by the thousand (every rank of every job). Where
    PYTHONDONTWRITEBYTECODE is set, as on CI's machines, none of them writes mpitrain's bytecode, so
    each one compiled every module again: 0.2 s more per job of 3 ranks on 2 cores (0.85-1.0 s
    against 1.05-1.2 s for `--steps 1`), minutes over the suite. Written once here (py_compile writes
    whatever that variable says; it only stops Python writing on import)."""
    import compileall

    import mpitrain

    compileall.compile_dir(Path(mpitrain.__file__).parent, quiet=1)


def mpirun_path() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if not found:
        pytest.skip("no mpirun on PATH (pip install 'mpitrain[mpich]')")
    # Tests kill launchers on purpose, many times: their folders go before each launch (each job's
    # rank 0 sweeps them too; mpiimpl.Impl.session_prefix).
    mpiimpl.sweep_sessions(_impl_of(found))
    return found


@functools.cache
def _impl_of(mpirun: str) -> mpiimpl.Impl:
    return mpiimpl.of_mpirun(mpirun)


@functools.cache
def mpi_impl() -> mpiimpl.Impl:
    """The MPI implementation whose mpirun the tests launch (MPICH or Open MPI: CI runs the suite
    under each)."""
    return _impl_of(mpirun_path())


def launcher_flags() -> list[str]:
    """The flags every test job needs from mpirun (Open MPI: root, 3 ranks on 2 cores)."""
    return mpiimpl.local_flags(mpi_impl())


def launcher() -> list[str]:
    return [mpirun_path(), *launcher_flags()]


def keep_going() -> tuple[str, ...]:
    """mpirun's flags for a job that goes on without a lost rank, on this MPI."""
    return mpi_impl().keep_going


def only_on(name: str, why: str):
    """Skip a test that holds for one MPI implementation only, saying why."""
    return pytest.mark.skipif(mpi_impl().name != name, reason=f"{mpiimpl.IMPLS[name].title} only: {why}")


# For a test of numbers and files (what a run computes, reads or writes), whose MPI calls every
# other test makes too: one MPI is enough. What differs between MPIs, the launchers, faults, stops
# and progress, runs under both. It keeps CI (both suites, one after the other) within its time.
NUMBERS_ONLY = "numbers and files, the same under either MPI; launchers and faults run under both"
# A variant of a case that runs under both MPIs: the same MPI calls, launcher and kind of fault (a
# worker killed, a signal to mpirun); what differs is mpitrain's own logic (a mode, a quorum, which
# worker, what it measures), which does not depend on the MPI. One MPI is enough for the variant.
OWN_LOGIC = "mpitrain's own logic over the MPI calls and faults that the cases run under both MPIs make"


def own_lines(text: str) -> list[str]:
    """What mpitrain itself wrote: Open MPI's launcher adds its own message, framed by lines of
    dashes, when a rank exits non-zero (hydra adds nothing to a clean exit 2), and may leave a NUL
    byte after the box, before the next process's line (seen in CI). Its event library may also
    warn as ranks exit together ("[warn] Epoll MOD(4) on fd 29 failed. Old events were 6; ...: Bad
    file descriptor", seen once in CI), and its PMIx server may find an exited rank unreachable
    ("[host:04878] PMIX ERROR: PMIX_ERR_UNREACH in file .../pmix_server.c at line 3146", seen once in
    CI after an exit 2 on every rank): not mpitrain's either."""
    out, boxed = [], False
    for line in text.replace("\0", "").splitlines():
        if line.startswith("-" * 20):
            boxed = not boxed
        elif not boxed and not line.startswith(LIBEVENT_WARNING) and not PMIX_ERROR.match(line):
            out.append(line)
    return out


LIBEVENT_WARNING = "[warn] "  # libevent's prefix (Open MPI's launcher), never one of mpitrain's lines
PMIX_ERROR = re.compile(r"\[[^\]]*\] PMIX ERROR: ")  # PMIx's own "[host:pid] PMIX ERROR: ..." (Open MPI)


@pytest.fixture
def mpi() -> mpiimpl.Impl:
    return mpi_impl()


def child_env() -> dict:
    env = dict(os.environ)
    for var in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_ID"):  # tests may run inside a Slurm job
        env.pop(var, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_mpitrain(np_: int, *args: str, timeout: float = MPI_TIMEOUT_S, env: dict | None = None,
                 cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`mpirun -np np_ python -m mpitrain ARGS` (np_ == 0: plain `python -m mpitrain`, no launcher)."""
    cmd = [sys.executable, "-m", "mpitrain", *args]
    if np_ > 0:
        cmd = [*launcher(), "-np", str(np_), *cmd]
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=cwd)
        if not launcher_did_not_start(proc):
            break
    return proc


# Open MPI's prterun, rarely (once in about 2,000 launches of the suite), fails before it starts any
# rank: "The PMIx server's listener thread failed to start", exit 213 (seen in Open MPI's own issue
# trackers and other projects' CI as well). Nothing of the job ran, so the launch helpers try once more.
LAUNCHER_START_FAILURE = "The PMIx server's listener thread failed to start"


def launcher_did_not_start(proc) -> bool:
    return proc.returncode == 213 and LAUNCHER_START_FAILURE in (proc.stdout or "") + (proc.stderr or "")


def train(np_: int, tmp_path: Path, *args: str, **kw) -> dict:
    """Run a training that must succeed; return its summary JSON."""
    summary = tmp_path / f"summary-{np_}-{abs(hash(args))}.json"
    proc = run_mpitrain(np_, "--no-progress", "--summary-json", str(summary), *args, **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data = json.loads(summary.read_text())
    data["_stdout"] = proc.stdout
    data["_stderr"] = proc.stderr
    return data


def run_detached(cmd: list[str], timeout: float = MPI_TIMEOUT_S, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` in its own session; on timeout kill the whole session (under
    `mpirun -disable-auto-cleanup` ranks may outlive mpirun) and fail. Returns (result, seconds);
    result.leftovers tells whether any process of the session outlived the command."""
    import time

    for _ in range(2):
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(),
                                start_new_session=True)
        out, err = communicate_or_kill(proc, timeout)
        elapsed = time.monotonic() - t0
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        result.leftovers = kill_session(proc)
        if not launcher_did_not_start(result):
            break
    return result, elapsed


def kill_session(proc: subprocess.Popen) -> bool:
    """SIGKILL whatever is left of a command started in its own session, faults.LINGER_S after it
    ended; True if anything was (with the keep-going flag ranks may outlive mpirun: a test says
    whether they did)."""
    from mpitrain.launch import faults

    return faults.kill_session(proc.pid, faults.LINGER_S if proc.poll() is not None else 0.0)


def read_summary(path, output: str) -> dict:
    """A run's --summary-json; when there is none, the test fails with the run's output. A kill can
    meet MPICH's documented stuck ending (stuck.py), which writes no summary: its line must be in the
    failure's text for the one rerun (pyproject.toml) to apply (CI, 2026-11-28: FileNotFoundError
    instead, and no rerun)."""
    assert os.path.exists(path), f"no summary at {path}:\n{output}"
    with open(path) as f:
        return json.load(f)


def waiting_on_hydra(pid: int, deadline: float) -> bool:
    """Whether process `pid` (a rank under hydra) comes to wait on its PMI socket before `deadline`: a read
    of the PMI_FD it was given, as MPI_Init's exchanges and MPI_Comm_spawn wait on hydra's answer."""
    pmi_fd = next(int(v.split(b"=")[1]) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                  if v.startswith(b"PMI_FD="))
    while time.monotonic() < deadline:
        syscall = open(f"/proc/{pid}/syscall").read().split()
        if syscall[0] == "0" and int(syscall[1], 16) == pmi_fd:
            return True
        time.sleep(0.02)
    return False


def in_kernel(pid: int, function: str) -> bool:
    """Whether process `pid` sleeps in a kernel function whose name holds `function` (/proc/PID/wchan)."""
    try:
        return function in open(f"/proc/{pid}/wchan").read()
    except OSError:
        return False


def kill_while_hydra_owes_it(launcher: int, victim: int, what: str, wait_s: float) -> None:
    """SIGKILL `victim` (a rank under hydra) while hydra owes it an answer, for certain: mpiexec (`launcher`)
    is stopped so that every answer it owes waits, `victim` is killed once it waits on its PMI socket, and
    mpiexec goes on once the victim's supervisor has seen the death and holds the socket (it polls it:
    supervise._let_answers_land). Without that hold the proxy's late write killed hydra, every time."""
    from mpitrain.launch.samehost import stat_fields

    supervisor = int(stat_fields(victim)[1])
    os.kill(launcher, signal.SIGSTOP)
    try:
        assert waiting_on_hydra(victim, time.monotonic() + wait_s), f"{what} never waited on hydra"
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not in_kernel(supervisor, "poll"):
            time.sleep(0.005)
    finally:
        os.kill(launcher, signal.SIGCONT)


def communicate_or_kill(proc: subprocess.Popen, timeout: float = MPI_TIMEOUT_S) -> tuple[str, str]:
    """(stdout, stderr) of a command started in its own session; past the timeout the whole
    session is killed and the test fails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\nstdout:\n{out}\nstderr:\n{err}")


def wait_for_training(proc: subprocess.Popen, np_: int, timeout: float = MPI_TIMEOUT_S) -> list[str]:
    """Read `proc`'s stdout until rank 0 has announced every rank (it does so once all of them are
    past MPI_Init and set up, just before training), so that a test acting on a rank from outside
    hits training and not start-up, however slow the machine. Returns the lines read; the caller's
    later communicate() gets the rest. A rank killed inside MPI_Init is another case: README,
    "When things go wrong"."""
    import time

    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("the job ended before training:\n" + "".join(lines))
        lines.append(line)
        if line.startswith(f"rank {np_ - 1} "):
            return lines
    pytest.fail("training did not start in time:\n" + "".join(lines))


def logged_step(events: Path) -> int:
    """The newest global step in rank 0's --log-dir events (0: none yet)."""
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["global_step"] for line in lines if '"global_step"' in line and line.endswith("}")]
    return steps[-1] if steps else 0


def wait_for_step(proc: subprocess.Popen, events: Path, step: int, timeout: float = MPI_TIMEOUT_S) -> int:
    """Wait until rank 0's log (--log-dir's events.jsonl, every --log-every steps) shows global
    step `step` or later: a test acting from outside then hits a known point of training, not a
    guess at how fast this machine runs (a guess that once landed after the last step). Returns
    the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = logged_step(events)
        if seen >= step:
            return seen
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before its log showed step {step}")
        time.sleep(0.005)
    pytest.fail(f"rank 0's log did not reach step {step} in {timeout} s")


def wait_for_checkpoint(proc: subprocess.Popen, directory: Path, timeout: float = MPI_TIMEOUT_S) -> Path:
    """Wait until rank 0 has saved a checkpoint in `directory`: training is under way, past the
    step it is saved at (an event, not a guess at how long start-up takes on a busy machine)."""
    import time

    from mpitrain.duties.checkpoint import list_checkpoints

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list_checkpoints(directory) if directory.is_dir() else []
        if found:
            return found[-1]
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before its first checkpoint")
        time.sleep(0.01)
    pytest.fail(f"no checkpoint in {directory} after {timeout} s")


def mpitrain_cmd(np_: int, *args: str, launcher_flags: tuple[str, ...] = ()) -> list[str]:
    return [*launcher(), *launcher_flags, "-np", str(np_), sys.executable, "-m", "mpitrain", *args]


class Lines:
    """A stream's lines as they come, read by a thread (the test waits for words in them)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")), daemon=True)
        self._thread.start()

    def count(self, text: str) -> int:
        return sum(text in ln for ln in list(self.lines))

    def wait(self, text: str, count: int = 1, timeout: float = MPI_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while self.count(text) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.count(text) >= count

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)
