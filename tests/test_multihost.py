"""A real multi-host run: two network namespaces joined by a veth pair act as two hosts, and
MPICH's launcher starts ranks on both from a hostfile (recipe: ../shared/notes/multi-host-with-namespaces.md).

Traffic stays between the two namespaces this test creates, on a private /24 it picks.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, mpirun_path, only_on

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns  # noqa: E402  (benchmarks/netns.py: the namespaces, shared with benchmarks/slowlink.py)

pytestmark = [pytest.mark.timeout(300),
              only_on("mpich", "the namespaces are joined through hydra's -launcher-exec (an ssh stand-in)")]


@pytest.fixture
def two_hosts(tmp_path):
    try:
        with netns.two_hosts(tmp_path) as (names, addrs, wrapper, _):
            yield names, addrs, wrapper
    except netns.Unavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("slots,np_,num_ps,placed", [
    (2, 3, 1, [0, 0, 1]),  # ranks 0,1 on the first host, rank 2 on the second
    # one slot per host: hydra deals the ranks round-robin, so each server (ranks 0, 1) is on its
    # own host, with a worker beside it
    (1, 4, 2, [0, 1, 0, 1]),
])
def test_training_across_two_hosts_from_a_hostfile(two_hosts, tmp_path, slots, np_, num_ps, placed):
    names, addrs, wrapper = two_hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{addrs[0]}:{slots}\n{addrs[1]}:{slots}\n")
    summary = tmp_path / "summary.json"
    # each rank reports the network namespace it runs in, then becomes the trainer
    rank_cmd = (f'echo "rank $PMI_RANK netns $(readlink /proc/self/ns/net)"; '
                f'exec "{sys.executable}" -m mpitrain --no-progress --epochs 10 --num-ps {num_ps} '
                f'--summary-json "{summary}"')
    cmd = ["ip", "netns", "exec", names[0], mpirun_path(), "-launcher", "ssh", "-launcher-exec", str(wrapper),
           "-f", str(hostfile), "-localhost", addrs[0], "-np", str(np_), "sh", "-c", rank_cmd]
    # TCP only: by default UCX sees one machine behind the namespaces and would pass the data through
    # shared memory, never over the veth (docs/notes/ucx-shm-across-namespaces.md)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**child_env(), **netns.OVER_TCP})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ns_of = {}
    for line in proc.stdout.splitlines():
        if line.startswith("rank ") and " netns " in line:
            _, rank, _, ns = line.split()
            ns_of[int(rank)] = ns
    assert len(ns_of) == np_
    first = ns_of[0]
    assert [0 if ns_of[r] == first else 1 for r in range(np_)] == placed
    s = json.loads(summary.read_text())
    assert s["world_size"] == np_ and s["num_ps"] == num_ps and s["test_accuracy"] >= 0.85
    assert all(p["bytes_in"] > 0 for p in s["ps_shards"])  # (both namespaces share one host name)
