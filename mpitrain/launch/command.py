"""`mpitrain launch`: check a hostfile, then start the job with mpirun across its hosts.

    mpitrain launch -f hostfiles/mpich.hosts [-np N] [--keep-going] [trainer flags...] [-- mpirun flags...]

A hostfile mistake (missing file, bad line, zero slots, more ranks than slots) is reported in one
line with exit code 2 before any process starts, instead of as an MPI launcher error. Both
MPICH (`host:slots`) and Open MPI (`host slots=N`) syntax are read; mpirun gets a hostfile in
the syntax of the MPI it belongs to. `--keep-going` becomes that MPI's flag for going on without a
lost worker (mpiimpl.Impl.keep_going); flags after `--` go to mpirun as they are.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from mpitrain.core.config import UsageError
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.launch.mpiimpl import Impl, of_mpirun

_MPICH_LINE = re.compile(r"^(?P<host>[^\s:#]+)(?::(?P<slots>\S+))?$")
_OPENMPI_LINE = re.compile(r"^(?P<host>[^\s:#=]+)(?P<opts>(?:\s+\S+=\S+)*)$")


def _lines(path: str) -> list[tuple[int, str, str]]:
    """(line number, the line as written, its content without comment or blanks) of each line
    that holds something."""
    out = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append((number, raw, line))
    return out


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """[(host, slots), ...] in file order. Raises UsageError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hostfile {path} does not exist; see hostfiles/ for examples")
    hosts = []
    for number, raw, line in _lines(path):
        where = f"{path}:{number}: {raw.strip()!r}"
        m = _MPICH_LINE.match(line)
        if m:
            host, slots = m["host"], m["slots"] if m["slots"] is not None else "1"
        else:
            m = _OPENMPI_LINE.match(line)
            if not m:
                raise UsageError(f"{where} is not a hostfile line; write HOST:SLOTS (MPICH) or "
                                 "HOST slots=N (Open MPI)")
            host, slots = m["host"], "1"
            for opt in m["opts"].split():
                key, _, value = opt.partition("=")
                if key == "slots":
                    slots = value
                elif key != "max_slots":
                    raise UsageError(f"{where}: unknown option {key!r}; only slots=N and max_slots=N are read")
        if not slots.isdigit():
            raise UsageError(f"{where}: slots must be a whole number, not {slots!r}")
        if int(slots) == 0:
            raise UsageError(f"{where}: zero slots; give the host at least one slot or remove the line")
        hosts.append((host, int(slots)))
    if not hosts:
        raise UsageError(f"hostfile {path} names no host; one line per host, e.g. node-a:2")
    return hosts


def hostfile_syntax(path: str) -> str:
    """"mpich" (host:slots), "openmpi" (host slots=N), or "plain" (host names only: both read it)."""
    lines = [line for _, _, line in _lines(path)]
    if any("slots=" in line for line in lines):
        return "openmpi"
    return "mpich" if any(":" in line for line in lines) else "plain"


def launcher_hostfile(path: str, hosts: list[tuple[str, int]], impl: Impl, keep: bool, tmp: Path) -> Path:
    """A hostfile this mpirun reads: the user's own when it is in the MPI's syntax (so a printed
    command names a file that stays), else a converted copy, in `tmp` or, for a command printed to
    run later (`keep`), in a file that is not deleted."""
    if hostfile_syntax(path) in ("plain", impl.name):
        return Path(path).resolve()
    text = "".join(impl.hostfile_line(h, s) + "\n" for h, s in hosts)
    if keep:
        fd, name = tempfile.mkstemp(prefix="mpitrain-hosts-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    out = tmp / "hosts"
    out.write_text(text)
    return out


def build_command(mpirun: str, impl: Impl, hostfile: Path, np_: int, trainer_args: list[str],
                  mpirun_args: list[str], keep_going: bool) -> list[str]:
    keep = list(impl.keep_going) if keep_going else []
    return [mpirun, impl.hostfile_flag, str(hostfile), *keep, *mpirun_args, "-np", str(np_),
            sys.executable, "-m", "mpitrain", *trainer_args]


def unresolved_hosts(names: list[str]) -> list[str]:
    """The host names this machine cannot resolve (mpirun would fail on them in ssh's or hydra's words)."""
    bad = []
    for host in names:
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError):
            bad.append(host)
    return bad


def rank_hosts(hosts: list[tuple[str, int]], np_: int) -> list[str]:
    """The host of each rank: mpirun fills each host's slots in file order (MPICH's and Open
    MPI's default placement by slot)."""
    return [host for host, slots in hosts for _ in range(slots)][:np_]


def server_lines(hosts: list[tuple[str, int]], np_: int, trainer_args: list[str]) -> list[str]:
    """Which host serves which shard (--num-ps among the trainer's flags): rank 0 needs a free
    core most, and with several servers each should get one."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-ps", type=int, default=1)
    try:
        K = p.parse_known_args(trainer_args)[0].num_ps
    except SystemExit:  # a bad value: the trainer itself says so in one line
        return []
    if np_ < 2 or not 1 <= K < np_:
        return []
    placed = rank_hosts(hosts, np_)
    if K == 1:
        return [f"mpitrain launch: parameter server: rank 0 on {placed[0]}"]
    return [f"mpitrain launch: parameter-server shard {k}/{K}: rank {k} on {placed[k]}" for k in range(K)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpitrain launch", description=__doc__.splitlines()[0])
    p.add_argument("-f", "--hostfile", required=True)
    p.add_argument("-np", "--np", type=int, dest="np_", metavar="N", help="number of ranks (default: all slots)")
    p.add_argument("--mpirun", default=None, help="the mpirun to use (default: the one beside this Python, else PATH)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the mpirun command instead of running it (host names are not resolved)")
    p.add_argument("--keep-going", action="store_true",
                   help="a lost worker does not end the job: mpirun -disable-auto-cleanup (MPICH) or "
                        "--with-ft ulfm (Open MPI)")
    p.epilog = "Flags after -- go to mpirun as they are, e.g. -- --oversubscribe (Open MPI)."
    cut = argv.index("--") if "--" in argv else len(argv)
    mpirun_args = argv[cut + 1:]
    args, trainer_args = p.parse_known_args(argv[:cut])
    try:
        hosts = parse_hostfile(args.hostfile)
        total = sum(s for _, s in hosts)
        np_ = args.np_ if args.np_ is not None else total
        if np_ < 1:
            raise UsageError(f"-np must be at least 1 (got {np_})")
        if np_ > total:
            raise UsageError(f"-np {np_} is more than the {total} slots in {args.hostfile}; add slots or lower -np")
        beside = Path(sys.executable).parent / "mpirun"
        mpirun = args.mpirun or (str(beside) if beside.exists() else shutil.which("mpirun"))
        if not mpirun:
            raise UsageError("no mpirun found; pip install 'mpitrain[mpich]' or load your MPI module")
        impl = of_mpirun(mpirun)
        # hydra contacts the hosts that get ranks; prterun starts a daemon on every host of the file
        contacted = [h for h, _ in hosts] if impl.contacts_every_host else rank_hosts(hosts, np_)
        bad = [] if args.dry_run else unresolved_hosts(list(dict.fromkeys(contacted)))
        if bad:
            raise UsageError(f"{args.hostfile} names host(s) this machine cannot resolve: {', '.join(bad)}; fix the "
                             f"name(s), or add them to /etc/hosts or DNS")
    except UsageError as e:
        say(f"mpitrain launch: error: {e}", sys.stderr)
        return ExitCode.USAGE
    for line in server_lines(hosts, np_, trainer_args):
        say(line)
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = launcher_hostfile(args.hostfile, hosts, impl, args.dry_run, Path(tmp))
        cmd = build_command(mpirun, impl, hostfile, np_, trainer_args, mpirun_args, args.keep_going)
        if args.dry_run:  # to run later, or elsewhere: no host is contacted or resolved here
            say(" ".join(shlex.quote(part) for part in cmd))
            return 0
        return subprocess.call(cmd, env=os.environ)
