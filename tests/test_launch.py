"""`mpitrain launch`: hostfile checks before anything starts, then mpirun across the hosts."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import MPI_TIMEOUT_S, child_env, launcher_flags, own_lines, run_mpitrain

from mpitrain.core.config import UsageError
from mpitrain.launch.command import parse_hostfile


def test_reads_mpich_and_openmpi_syntax(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# comment\nnode-a:3\n\nnode-b  # one slot\nnode-c slots=2 max_slots=4\n")
    assert parse_hostfile(str(f)) == [("node-a", 3), ("node-b", 1), ("node-c", 2)]


def test_example_hostfiles_parse():
    assert parse_hostfile("hostfiles/mpich.hosts") == [("node-a", 3), ("node-b", 2)]
    assert parse_hostfile("hostfiles/openmpi.hosts") == [("node-a", 3), ("node-b", 2)]


@pytest.mark.parametrize("text,needle", [
    ("node-a:0\n", "zero slots"),
    ("node-a:two\n", "slots must be a whole number"),
    ("node-a slots=2 cpus=4\n", "unknown option 'cpus'"),
    ("node a b\n", "is not a hostfile line"),
    ("# nothing\n", "names no host"),
])
def test_bad_hostfile_lines(tmp_path, text, needle):
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(UsageError, match=needle):
        parse_hostfile(str(f))


@pytest.mark.parametrize("content,args,needle", [
    (None, [], "does not exist"),
    ("localhost:0\n", [], "zero slots"),
    ("localhost:2\n", ["-np", "3"], "-np 3 is more than the 2 slots"),
])
def test_launch_refuses_bad_hostfiles_in_one_line(tmp_path, content, args, needle):
    f = tmp_path / "hosts"
    if content is not None:
        f.write_text(content)
    proc = run_mpitrain(0, "launch", "-f", str(f), *args)
    assert proc.returncode == 2
    assert len(own_lines(proc.stderr)) == 1 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_launch_runs_the_trainer_on_the_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("localhost slots=3\n")  # Open MPI syntax, handed to MPICH as localhost:3
    summary = tmp_path / "s.json"
    proc = run_mpitrain(0, "launch", "-f", str(f), "--no-progress", "--epochs", "5", "--summary-json", str(summary),
                        "--", *launcher_flags())  # Open MPI: root, 3 ranks on 2 cores
    assert proc.returncode == 0, proc.stderr
    s = json.loads(summary.read_text())
    assert s["world_size"] == 3 and s["config"]["epochs"] == 5


def test_launch_says_which_host_serves_which_shard(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("localhost:1\n127.0.0.1:3\n")
    proc = run_mpitrain(0, "launch", "-f", str(f), "-np", "4", "--dry-run", "--num-ps", "2", "--mode", "sync")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["mpitrain launch: parameter-server shard 0/2: rank 0 on localhost",
                         "mpitrain launch: parameter-server shard 1/2: rank 1 on 127.0.0.1"], lines
    assert lines[2].split()[-4:] == ["--num-ps", "2", "--mode", "sync"]  # the trainer gets the flag


@pytest.mark.parametrize("content", ["localhost:3\n", "localhost slots=3\n"])
def test_a_dry_run_prints_a_command_whose_hostfile_still_exists(tmp_path, content, mpi):
    """It printed `mpirun -f /tmp/.../hosts` of a folder deleted as it returned: the printed command
    could never run. Now it names the user's own file (same syntax) or a converted copy that stays."""
    import shlex

    f = tmp_path / "hosts"
    f.write_text(content)
    proc = run_mpitrain(0, "launch", "-f", str(f), "--dry-run", "--steps", "3", "--no-progress", "--",
                        *launcher_flags())
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.splitlines()[-1])
    named = Path(cmd[cmd.index(mpi.hostfile_flag) + 1])
    assert named.is_file() and "localhost" in named.read_text()
    if content.strip() == mpi.hostfile_line("localhost", 3):
        assert named == f.resolve()  # already this MPI's syntax: the user's file itself
    ran = subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=child_env())
    assert ran.returncode == 0 and "global step 3" in ran.stdout, ran.stdout + ran.stderr
    if named != f.resolve():
        named.unlink()


def test_keep_going_and_flags_after_the_separator_reach_mpirun(tmp_path, mpi):
    """--keep-going is this MPI's own flag (hydra rejects Open MPI's and the other way round: exit
    213 before anything runs); what follows -- goes to mpirun, never to the trainer."""
    import shlex

    f = tmp_path / "hosts"
    f.write_text("localhost:2\n")
    proc = run_mpitrain(0, "launch", "-f", str(f), "--dry-run", "--keep-going", "--steps", "3", "--",
                        "-x", "SOME_VAR")
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.splitlines()[-1])
    np_at, trainer_at = cmd.index("-np"), cmd.index("mpitrain")
    assert cmd[np_at - 2:np_at] == ["-x", "SOME_VAR"] and "SOME_VAR" not in cmd[trainer_at:]
    keep = list(mpi.keep_going)
    assert any(cmd[i:i + len(keep)] == keep for i in range(np_at)), cmd
    assert cmd[trainer_at + 1:] == ["--steps", "3"]


def test_launch_refuses_a_host_name_that_does_not_resolve(tmp_path, mpi):
    f = tmp_path / "hosts"
    f.write_text("localhost:2\nno-such-host.invalid:2\n")
    proc = run_mpitrain(0, "launch", "-f", str(f), "-np", "4", timeout=60)
    assert proc.returncode == 2 and len(own_lines(proc.stderr)) == 1, proc.stderr
    assert "cannot resolve: no-such-host.invalid" in proc.stderr and "Traceback" not in proc.stderr
    fits = run_mpitrain(0, "launch", "-f", str(f), "-np", "2", "--steps", "2", "--no-progress",  # only localhost
                        "--", *launcher_flags())
    if mpi.contacts_every_host:  # Open MPI's prterun would ssh to it all the same
        assert fits.returncode == 2 and "cannot resolve: no-such-host.invalid" in fits.stderr, fits.stderr
    else:
        assert fits.returncode == 0, fits.stderr
