"""Two "hosts" on one machine: network namespaces joined by a veth pair, and a launcher wrapper
that lets MPICH's hydra start ranks in either (recipe: ../shared/notes/multi-host-with-namespaces.md);
or several, each with its own link to a bridge (switched_hosts). Used by tests/test_multihost.py,
benchmarks/slowlink.py and benchmarks/time_to_accuracy.py. Needs root and iproute2 (`tc` for
shaping). Traffic stays on a private /24 between the namespaces.
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
    tag = uuid.uuid4().hex[:6]
    names = [f"mpta{tag}", f"mptb{tag}"]
    addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
    veths = [f"va{tag}", f"vb{tag}"]
    with _namespaces(names):
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth, addr in zip(names, veths, addrs):
            _plug(ns, veth, addr)
        yield names, addrs, _wrapper(workdir, names, addrs, own_hostnames), dict(zip(names, veths))


@contextlib.contextmanager
def switched_hosts(workdir: Path, count: int):
    """`count` hosts, each with one link to a switch (a bridge in a namespace of its own), as hosts on
    one Ethernet switch are: yields (host namespace names, their addresses, the launcher wrapper, the
    ports to shape: (namespace, device) of both ends of every host's link, so that each host sends
    and receives at the shaped rate whoever it talks to)."""
    tag = uuid.uuid4().hex[:6]
    names = [f"mpt{i}{tag}" for i in range(count)]
    switch = f"mpts{tag}"
    addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]
    with _namespaces([*names, switch]):
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ports = []
        for i, (ns, addr) in enumerate(zip(names, addrs)):
            nic, port = f"vh{i}{tag}", f"vs{i}{tag}"
            _ip("link", "add", nic, "type", "veth", "peer", "name", port)
            _plug(ns, nic, addr)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            ports += [(ns, nic), (switch, port)]
        _ip("-n", switch, "link", "set", "br0", "up")
        yield names, addrs, _wrapper(workdir, names, addrs, False), ports


@contextlib.contextmanager
def _namespaces(names: list[str]):
    """Makes these network namespaces (each with its loopback up), and deletes them afterwards with
    the veths in them; Unavailable where it cannot."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise Unavailable("network namespaces need root and iproute2")
    made = []
    try:
        for ns in names:
            if _ip("netns", "add", ns, check=False).returncode != 0:
                raise Unavailable("cannot create network namespaces here")
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)  # the veth pairs go with them


def _plug(ns: str, veth: str, addr: str) -> None:
    """Moves one end of a veth pair into host namespace `ns` as its network card, at `addr`."""
    _ip("link", "set", veth, "netns", ns)
    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
    _ip("-n", ns, "link", "set", veth, "up")


def _wrapper(workdir: Path, names: list[str], addrs: list[str], own_hostnames: bool) -> Path:
    """hydra's ssh launcher (and Open MPI's plm_ssh_agent) calls WRAPPER [options] HOST command...: this
    script runs the command in HOST's namespace."""
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
    return wrapper


def on_host(name: str, cmd: list[str], own_hostnames: bool = False) -> list[str]:
    """`cmd` run in namespace `name` (a launcher: mpiexec, prterun), in its own UTS namespace too."""
    if not own_hostnames:
        return ["ip", "netns", "exec", name, *cmd]
    return ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", f'hostname h{name}; exec "$@"', "sh", *cmd]


RATES = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6, "10mbit": 10e6}  # tc rate -> bits/s


def shape(ports, rate: str | None) -> None:
    """Each (namespace, device) of `ports` sends at `rate` (a key of RATES) with a token bucket (tc tbf:
    netem, which would add latency, is not in this machine's kernel); None removes the shaping. Both
    ends of a link: both directions (two_hosts: `veths.items()`)."""
    for ns, dev in ports:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True, timeout=30)
        if rate:
            burst = max(64_000, int(RATES[rate] / 8 / 250))  # >= 4 ms of traffic: the timer ticks at <= 1 kHz
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", str(burst), "latency", "20ms"], check=True, capture_output=True,
                           timeout=30)
