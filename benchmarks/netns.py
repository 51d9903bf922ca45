"""Two "hosts" on one machine: network namespaces joined by a veth pair, and a launcher wrapper
that lets MPICH's hydra start ranks in either (recipe: ../shared/notes/multi-host-with-namespaces.md).
Used by tests/test_multihost.py and benchmarks/slowlink.py. Needs root and iproute2 (`tc` for
shaping). Traffic stays on a private /24 between the two namespaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

SUBNET = "10.231.77"  # private; only the two namespaces below use it
# By default MPICH's UCX netmod sees one machine behind the two namespaces and moves the data
# through shared memory, never over the veth (docs/notes/ucx-shm-across-namespaces.md): to cross
# the link, as two real hosts would, force TCP.
OVER_TCP = {"UCX_TLS": "tcp,self"}


class Unavailable(Exception):
    """Namespaces cannot be made here (not root, no iproute2, or refused); the message says which."""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@contextlib.contextmanager
def two_hosts(workdir: Path, own_hostnames: bool = False):
    """Yields (namespace names, their addresses, the launcher wrapper, the veth names by namespace);
    removes everything afterwards. `own_hostnames`: the wrapper also gives each host its own UTS
    namespace named h<namespace> (Open MPI tells hosts apart by name: with one name for both, its
    MPI_Comm_split_type(SHARED) spanned them and hung; run the launcher itself through `on_host`)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise Unavailable("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    names = [f"mpta{tag}", f"mptb{tag}"]
    addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
    veths = [f"va{tag}", f"vb{tag}"]
    made = []
    try:
        for ns in names:
            if _ip("netns", "add", ns, check=False).returncode != 0:
                raise Unavailable("cannot create network namespaces here")
            made.append(ns)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth, addr in zip(names, veths, addrs):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # hydra's ssh launcher (and Open MPI's plm_ssh_agent) calls WRAPPER [options] HOST command...: run the
        # command in HOST's namespace
        wrapper = Path(workdir) / "netns-launch"
        run = 'unshare --uts bash -c "hostname h$ns; $*"' if own_hostnames else 'bash -c "$*"'
        cases = "\n".join(f'    {a}) ns={n} ;;' for a, n in zip(addrs, names))
        wrapper.write_text(f"""#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
host="$1"; shift
case "$host" in
{cases}
    *) echo "netns-launch: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" {run}
""")
        wrapper.chmod(0o755)
        yield names, addrs, wrapper, dict(zip(names, veths))
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)  # the veth pair goes with them


def on_host(name: str, cmd: list[str], own_hostnames: bool = False) -> list[str]:
    """`cmd` run in namespace `name` (a launcher: mpiexec, prterun), in its own UTS namespace too."""
    if not own_hostnames:
        return ["ip", "netns", "exec", name, *cmd]
    return ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", f'hostname h{name}; exec "$@"', "sh", *cmd]


RATES = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}  # tc rate -> bits/s


def shape(names: list[str], veths: dict[str, str], rate: str | None) -> None:
    """Both directions of the link at `rate` (a key of RATES) with a token bucket (tc tbf: netem,
    which would add latency, is not in this machine's kernel); None removes the shaping."""
    for ns in names:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veths[ns], "root"],
                       capture_output=True, timeout=30)
        if rate:
            burst = max(64_000, int(RATES[rate] / 8 / 250))  # >= 4 ms of traffic: the timer ticks at <= 1 kHz
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veths[ns], "root", "tbf",
                            "rate", rate, "burst", str(burst), "latency", "20ms"], check=True, capture_output=True,
                           timeout=30)
