"""A real single-node Slurm (controller + node daemon + munge) for the job-script tests.

Recipe from ../shared/notes/slurm-on-one-machine.md: Debian's slurm-wlm and munge, no systemd,
no cgroups (proctrack/linuxproc, task/none), MpiDefault=pmi2, more CPUs declared than the
machine has so that 4-task jobs can start on 2 cores. Everything lives in a temporary folder
(SLURM_CONF points at it); the daemons this module starts are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# libpmix-dev: Slurm's pmix plugin (srun --mpi=pmix, for Open MPI) dlopens pmix2/lib/libpmix.so, which
# only the -dev package installs (measured: "mpi_pmix.c:195: pmi/pmix: can not load PMIx library").
PACKAGES = ["slurm-wlm", "munge", "libpmix-dev"]
PMIX_LIB = "/usr/lib/*/pmix2/lib/libpmix.so"


class Unavailable(Exception):
    """Why a real Slurm cannot run here (the test skips with this reason)."""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def ensure_installed() -> None:
    import glob

    if shutil.which("slurmctld") and shutil.which("munged") and glob.glob(PMIX_LIB):
        return
    if os.geteuid() != 0:
        raise Unavailable("Slurm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise Unavailable("Slurm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], env=env, timeout=600)
    if proc.returncode != 0:  # stale package lists: refresh once
        _run(["apt-get", "update"], env=env, timeout=300)
        proc = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], env=env, timeout=600)
    if proc.returncode != 0 or not shutil.which("slurmctld"):
        raise Unavailable(f"apt-get could not install {' '.join(PACKAGES)}: {proc.stderr.strip()[-300:]}")


# A requeued job may start again only cred_expire + 1 s later (slurmctld's job_mgr.c: the new
# launch credential must post-date the old one's revocation; Slurm's default is 120 s, and asking it
# to start at once made the second run fail at once, 2 times in 4). A credential must outlive a
# step's launch, which takes a few seconds here: 20 s leaves room and cuts the requeue test by 100 s.
CRED_EXPIRE_S = 20

SLURM_CONF = """\
ClusterName=mpitrain-test
FirstJobId={first_job}
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/builtin
# The main scheduling pass runs every 60 s by default: a requeued job, held until its credentials
# expire, then waited up to a minute more for it (54 s in the requeue test, not 21).
SchedulerParameters=sched_interval=2
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 8):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.pids: list[int] = []
        self.cpus = cpus
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> None:
        ensure_installed()
        if os.geteuid() != 0:
            raise Unavailable("starting slurmd and munged needs root")
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # A fresh cluster would number its jobs from 1 again; real clusters do not reuse ids, and
        # MPICH names its shared memory after "<jobid>.<step>" (see node.unlink_init_shm).
        first_job = 1000 + int(time.time()) % 1_000_000
        self.conf.write_text(SLURM_CONF.format(host=self.host, root=self.root, cpus=self.cpus, first_job=first_job,
                                               ctld_port=_free_port(), d_port=_free_port(),
                                               cred_expire=CRED_EXPIRE_S))
        self._start_munge()
        for daemon, pidfile in (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
            proc = _run([daemon, "-f", str(self.conf)] + (["-c"] if daemon == "slurmctld" else []),
                        env=self.env, timeout=60)
            if proc.returncode != 0:
                raise Unavailable(f"{daemon} did not start: {proc.stderr.strip()[-300:]}")
            self.pids.append(self._read_pid(self.root / pidfile))
        deadline = time.time() + 60
        while time.time() < deadline:
            state = _run(["sinfo", "-h", "-o", "%T"], env=self.env, timeout=30).stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise Unavailable(f"the Slurm node never became idle (sinfo: {state!r}); see {self.root}/slurmd.log")

    def _start_munge(self) -> None:
        if _run(["munge", "-n"], timeout=10).returncode == 0:
            return  # a munged is already running
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        proc = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], timeout=30)
        if proc.returncode != 0:
            raise Unavailable(f"munged did not start: {proc.stderr.strip()[-300:]}")
        pidfile = Path("/run/munge/munged.pid")
        if pidfile.exists():
            self.pids.append(self._read_pid(pidfile))

    @staticmethod
    def _read_pid(path: Path) -> int:
        for _ in range(100):
            if path.exists() and path.read_text().strip():
                return int(path.read_text().strip())
            time.sleep(0.1)
        raise Unavailable(f"no PID file {path}")

    def stop(self) -> None:
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in self.pids:
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        self.pids.clear()

    def submit(self, script: Path, cwd: Path, env: dict, *args: str, sbatch_args=()) -> int:
        """sbatch [sbatch_args] SCRIPT [args: the script's own, i.e. trainer flags]."""
        proc = _run(["sbatch", "--parsable", *sbatch_args, str(script), *args], env={**self.env, **env}, cwd=cwd,
                    timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def scancel(self, job: int, *flags: str) -> None:
        proc = _run(["scancel", *flags, str(job)], env=self.env, timeout=30)
        if proc.returncode != 0:
            raise AssertionError(f"scancel failed: {proc.stderr}")

    def wait(self, job: int, timeout: float = 300) -> dict:
        """Poll squeue (faster than sbatch --wait); then the job's final fields from scontrol."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not _run(["squeue", "-h", "-j", str(job)], env=self.env, timeout=30).stdout.strip():
                break
            time.sleep(0.5)
        else:
            _run(["scancel", str(job)], env=self.env, timeout=30)
            raise AssertionError(f"job {job} did not finish in {timeout} s")
        out = _run(["scontrol", "show", "job", str(job)], env=self.env, timeout=30).stdout
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields
