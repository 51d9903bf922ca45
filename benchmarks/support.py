"""The one module a benchmark script reaches mpitrain's insides through; everything else it runs as a user does
(`mpirun ... python -m mpitrain`, or the Python API, `import mpitrain`).

    from support import IMPL, Job, rank_pids      # beside the script: sys.path holds benchmarks/

What is here, by job:

- launching as the benchmarks do: `mpirun()` (the one beside this Python), `env()` (one BLAS thread a rank),
  `machine()` (the line every results file names its machine with), `IMPL` (that mpirun's MPI);
- the fault hooks: `Job` (one mpirun in its own session, read line by line), `rank_pids` / `spawned_pids` (a job's
  real processes, from /proc), `kill_session`, `dump_stacks` (py-spy), `fill` (a full disk), `end_problems`;
- the pieces a probe times or drives on its own (the model, the gradient source, the shm store, the wire's
  messages, the stuck-MPI watchdog, ...): `INSIDE`, each loaded only when a script names it, as the package's
  own `import mpitrain` does (a GPU probe sets its environment first).

A module moving inside the package changes INSIDE's line and no script: tests/test_structure.py fails a script
that imports `mpitrain.<anything>` itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mpitrain") is None:  # not installed: this checkout's (an install, or PYTHONPATH=TREE of
    sys.path.insert(0, str(ROOT))  # an A/B against another checkout, is left to win)
PY = sys.executable

# Loaded when a script names it, as `import mpitrain` loads its API (a rank that must call supervise() first, a GPU
# probe that sets its environment first): name -> (module, attribute; None: the module itself)
INSIDE = {
    "mpiimpl": ("mpitrain.launch.mpiimpl", None), "local_flags": ("mpitrain.launch.mpiimpl", "local_flags"),
    "of_mpirun": ("mpitrain.launch.mpiimpl", "of_mpirun"), "MPICH": ("mpitrain.launch.mpiimpl", "MPICH"),
    "faults": ("mpitrain.launch.faults", None), "rank_pids": ("mpitrain.launch.faults", "rank_pids"),
    "spawned_pids": ("mpitrain.launch.faults", "spawned_pids"),
    "kill_session": ("mpitrain.launch.faults", "kill_session"), "LINGER_S": ("mpitrain.launch.faults", "LINGER_S"),
    "supervise": ("mpitrain.launch.supervise", "supervise"),
    "unlink_init_shm": ("mpitrain.node", "unlink_init_shm"),
    "ExitCode": ("mpitrain.core.exitcodes", "ExitCode"), "Layout": ("mpitrain.core.layout", "Layout"),
    "checkpoint": ("mpitrain.duties.checkpoint", None), "TrainState": ("mpitrain.duties.checkpoint", "TrainState"),
    "STUCK_LINE": ("mpitrain.membership.stuck", "STUCK_LINE"), "WATCHDOG": ("mpitrain.membership.stuck", "WATCHDOG"),
    "FORM_LIMIT_S": ("mpitrain.membership.join", "FORM_LIMIT_S"),
    "parse_args": ("mpitrain.cli", "parse_args"),
    **{name: ("mpitrain.core.config", name) for name in ("AUTO_OVERLAP_MAX_WORKERS", "DEFAULT_EPOCHS",
                                                          "DEFAULT_STALENESS_TOLERANCE")},
    "REGISTRY": ("mpitrain.core.optim", "REGISTRY"),
    "StalenessHold": ("mpitrain.core.optim", "StalenessHold"),
    "make_synthetic": ("mpitrain.core.data", "make_synthetic"),
    "epoch_batches": ("mpitrain.core.data", "epoch_batches"),
    "MLP": ("mpitrain.core.model", "MLP"), "PlainOps": ("mpitrain.core.model", "PlainOps"),
    "make_backend": ("mpitrain.core.backend", "make_backend"), "WIRE_DTYPES": ("mpitrain.core.codec", "WIRE_DTYPES"),
    "gradients": ("mpitrain.modes.gradients", None),
    "shm": ("mpitrain.exchange.shm", None), "SharedUpdate": ("mpitrain.exchange.shm_push", "SharedUpdate"),
    "Message": ("mpitrain.exchange.protocol", "Message"), "Part": ("mpitrain.exchange.protocol", "Part"),
    **{name: ("mpitrain.exchange.transport", name) for name in ("Poller", "PS_POLL_S", "TESTS_PER_WAKE",
                                                                 "WORKER_POLL_S")},
}


def _inside(name: str):
    """`from support import NAME` of a name in INSIDE, or IMPL (the MPI of mpirun(): it runs `mpirun --version`)."""
    if name == "IMPL":
        value = _inside("of_mpirun")(mpirun())
    elif name in INSIDE:
        module, attr = INSIDE[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
    else:
        raise AttributeError(f"module 'support' has no attribute {name!r}")
    globals()[name] = value  # once
    return value


__getattr__ = _inside  # the module's: a name not defined above


def mpirun() -> str:
    beside = Path(PY).parent / "mpirun"
    return str(beside) if beside.exists() else (shutil.which("mpirun") or "mpirun")


def env() -> dict:
    e = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        e[var] = "1"
    e.pop("SLURM_NTASKS", None)
    return e


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()  # "MPICH Version: 5.0.2"
    except ImportError:
        mpi = "no mpi4py"
    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = "not installed"
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, NumPy {numpy.__version__}, "
            f"{' '.join(mpi.split())}, PyTorch {tv}; no GPU on this machine")


def end_problems(code: int | None, leftovers: bool, text: str, summary: dict | None) -> list[str]:
    """What any soak's job must not end with (a hang, a traceback, a process left, no summary)."""
    problems = ["hang"] if code is None else []
    if "Traceback" in text:
        problems.append("traceback")
    if leftovers:
        problems.append("a process outlived mpirun")
    if summary is None:
        problems.append(f"no summary (exit {code})")
    return problems


class Job:
    """One mpirun in its own session, its output read line by line with arrival times."""

    def __init__(self, cmd: list[str], cwd: str):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                     cwd=cwd, start_new_session=True)
        self.lines: list[tuple[float, str, str]] = []  # (time, stream, line)
        self.stacks = ""  # of every rank of a job that hung (dump_stacks), before it is killed
        self._readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                         for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for r in self._readers:
            r.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, _, line in list(self.lines):
                if text in line:
                    return t
            if self.proc.poll() is not None:
                return None
            time.sleep(0.01)
        return None

    def finish(self, timeout: float) -> tuple[int | None, bool]:
        """(exit code or None when it hung, whether any process of its session outlived it)."""
        try:
            code = self.proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            code = None
            self.stacks = dump_stacks(self.proc.pid)
        for r in self._readers:
            r.join(timeout=5)
        # the session (Open MPI gives each rank a process group), once a rank on its way out is gone
        leftovers = _inside("kill_session")(self.proc.pid, _inside("LINGER_S") if code is not None else 0.0)
        if code is None:
            self.proc.wait()
        return code, leftovers

    def text(self, stream: str | None = None) -> str:
        return "\n".join(line for _, s, line in self.lines if stream is None or s == stream)


def dump_stacks(root: int, more: dict[str, int] | None = None) -> str:
    """Where every rank of a hung job is (and the processes in `more`, by name), Python and native
    frames (py-spy, when installed): the one thing a hang leaves to learn from, taken before the job
    is killed."""
    out = []
    ranks = _inside("rank_pids")(root, supervised=False)
    named = [(f"rank {rank}", pid) for rank, (pid, _) in sorted(ranks.items())]
    for name, pid in named + sorted((more or {}).items()):
        try:
            dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=30)
            out.append(f"--- {name} (pid {pid})\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"--- {name} (pid {pid}): no stack ({e})")
    return "\n".join(out)


def fill(directory: Path, leave: int = 0) -> None:
    """Write a file until the file system has no block left (a full scratch disk, a quota), then
    give `leave` bytes of it back."""
    filler = directory / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
