"""A real multi-host run: two network namespaces joined by a veth pair act as two hosts, and
MPICH's launcher starts ranks on both from a hostfile (recipe: ../shared/notes/multi-host-with-namespaces.md).

Traffic stays between the two namespaces this test creates, on a private /24 it picks.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import child_env, mpirun_path

SUBNET = "10.231.77"  # private; only the two namespaces below use it
pytestmark = pytest.mark.timeout(300)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    names = [f"mpta{tag}", f"mptb{tag}"]
    addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
    made = []
    try:
        for ns in names:
            if _ip("netns", "add", ns, check=False).returncode != 0:
                pytest.skip("cannot create network namespaces here")
            made.append(ns)
        va, vb = f"va{tag}", f"vb{tag}"
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, veth, addr in zip(names, (va, vb), addrs):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # hydra's ssh launcher calls WRAPPER [options] HOST command...: run the command in HOST's namespace
        wrapper = tmp_path / "netns-launch"
        cases = "\n".join(f'    {a}) ns={n} ;;' for a, n in zip(addrs, names))
        wrapper.write_text(f"""#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
case "$host" in
{cases}
    *) echo "netns-launch: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" bash -c "$*"
""")
        wrapper.chmod(0o755)
        yield names, addrs, wrapper
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)  # the veth pair goes with them


def test_training_across_two_hosts_from_a_hostfile(two_hosts, tmp_path):
    names, addrs, wrapper = two_hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{addrs[0]}:2\n{addrs[1]}:2\n")
    summary = tmp_path / "summary.json"
    # each rank reports the network namespace it runs in, then becomes the trainer
    rank_cmd = (f'echo "rank $PMI_RANK netns $(readlink /proc/self/ns/net)"; '
                f'exec "{sys.executable}" -m mpitrain --no-progress --epochs 10 --summary-json "{summary}"')
    cmd = ["ip", "netns", "exec", names[0], mpirun_path(), "-launcher", "ssh", "-launcher-exec", str(wrapper),
           "-f", str(hostfile), "-localhost", addrs[0], "-np", "3", "sh", "-c", rank_cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    netns = {}
    for line in proc.stdout.splitlines():
        if line.startswith("rank ") and " netns " in line:
            _, rank, _, ns = line.split()
            netns[int(rank)] = ns
    assert len(netns) == 3
    assert netns[0] == netns[1] != netns[2]  # ranks 0,1 on the first host, rank 2 on the second
    s = json.loads(summary.read_text())
    assert s["world_size"] == 3 and s["test_accuracy"] >= 0.85
