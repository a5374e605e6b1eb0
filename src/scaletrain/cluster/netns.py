"""Network namespaces for `scaletrain cluster rehearse --netns`: each rehearsed "node" gets a network stack of its
own, with one interface (eth0) and one address, as a machine has, instead of sharing this machine's loopback.

Topology: N node namespaces, each with a veth pair to a bridge in a hub namespace (a switch). Nothing is
created in this machine's own namespace: no interface, route or listener appears there, and the namespaces have
no route to it or to any other network, so the job's traffic cannot leave them. On its own link a rank's
traffic to another node crosses two veth pairs and a bridge at a 1500-byte MTU (loopback: 64 KiB), so the
bandwidth between nodes is a network's, not a memcpy's. ``gbps`` shapes each node's link with a token bucket
(tc's tbf) in both directions, as a NIC of that speed would: a slow link, or one slow node among fast ones, can
be rehearsed before the real network is rented.

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, and `tc` to shape); unavailable() says why not in one line. The
namespaces are named st-<pid>-*: removed on the way out, and by the next rehearsal when their process died.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError

SUBNET = "10.213.0"  # a private /24 that exists only inside the namespaces: nothing here can collide with it
_PREFIX = "st-"


@dataclass(frozen=True)
class Node:
    """One rehearsed machine: its namespace, its address and the interface holding it, its host name."""

    index: int
    namespace: str
    address: str
    interface: str = "eth0"

    @property
    def hostname(self) -> str:
        return f"node{self.index}"

    def run(self, command: list[str]) -> list[str]:
        """``command`` run inside this node's namespace, under its own host name where util-linux's unshare can
        give it one (a UTS namespace), so that ranks and stragglers are named by node as on real machines."""
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", self.hostname] \
            if shutil.which("unshare") else []
        return ["ip", "netns", "exec", self.namespace, *named, *command]


def _hosts(node: Node, nodes: list[Node]) -> None:
    """/etc/netns/NS/hosts, which `ip netns exec` puts over /etc/hosts: the nodes' names, and this machine's own
    name, resolve to addresses on the namespaces' network. torchrun's agent decides whether it hosts the
    rendezvous by resolving its host name; this machine's /etc/hosts would give an address no node has."""
    own = socket.gethostname()
    lines = ["127.0.0.1 localhost", *(f"{n.address} {n.hostname}" + (f" {own}" if n is node else "") for n in nodes)]
    folder = Path("/etc/netns") / node.namespace
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text("\n".join(lines) + "\n")


def unavailable(shaped: bool = False) -> str | None:
    """Why network namespaces cannot be made here (None when they can); ``shaped``: tc is needed too."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN) on Linux"
    if not _capable():
        return ("creating network namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN, which this root lacks "
                "(a restricted container)")
    for tool in ("ip", "tc") if shaped else ("ip",):
        if shutil.which(tool) is None:
            return f"iproute2's {tool!r} is not on PATH"
    return None


def _capable() -> bool:
    """This process holds CAP_NET_ADMIN (12: interfaces, addresses, qdiscs) and CAP_SYS_ADMIN (21: `ip netns
    add` mounts the namespace under /run/netns): root in a container often does not."""
    try:
        with open("/proc/self/status") as f:
            effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return all(effective >> bit & 1 for bit in (12, 21))


def _ip(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise UserError(f"--netns: {' '.join(args)} failed ({said}); fix: run as root on Linux with iproute2 "
                        "(and tc's tbf for --link-gbps), or drop --netns to rehearse on loopback")


def _existing() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _delete(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _orphans() -> list[str]:
    """Namespaces left by a rehearsal whose process is gone (killed before it could remove them)."""
    found = []
    for name in _existing():
        m = re.fullmatch(rf"{_PREFIX}(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            found.append(name)
    return found


def _shape(namespace: str, device: str, gbps: float) -> None:
    """A token bucket of ``gbps`` on ``device``'s egress: burst of 10 ms at that rate (at least 64 KiB, so the
    kernel's timer can keep up), packets queued up to 100 ms before they are dropped."""
    rate = int(gbps * 1e9)
    burst = max(64 * 1024, rate // 8 // 100)
    _ip("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
        "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms")


@contextlib.contextmanager
def namespaces(count: int, gbps: list[float] | None = None) -> Iterator[list[Node]]:
    """``count`` node namespaces joined by a bridge (module doc); ``gbps``: each node's link speed, one per node.
    Removed on the way out, whatever happened."""
    if count > 250:
        raise UserError(f"--nodes = {count}: expected at most 250 with --netns (one /24); fix: --nodes=250 or fewer")
    speeds = gbps or []
    _delete(_orphans())
    tag = f"{_PREFIX}{os.getpid()}"
    hub = f"{tag}-hub"
    nodes = [Node(i, f"{tag}-{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        for name in (hub, *(n.namespace for n in nodes)):
            _ip("ip", "netns", "add", name)
            made.append(name)
        _ip("ip", "-n", hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _ip("ip", "-n", hub, "link", "set", "br0", "up")
        for node in nodes:
            port = f"n{node.index}"
            _ip("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", node.interface,
                "netns", node.namespace)
            _ip("ip", "-n", hub, "link", "set", port, "master", "br0")
            _ip("ip", "-n", hub, "link", "set", port, "up")
            _ip("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("ip", "-n", node.namespace, "link", "set", node.interface, "up")
            _ip("ip", "-n", node.namespace, "link", "set", "lo", "up")
            _hosts(node, nodes)
            if speeds:
                _shape(node.namespace, node.interface, speeds[node.index])  # what the node sends
                _shape(hub, port, speeds[node.index])  # what it receives
        yield nodes
    finally:
        _delete(made)
