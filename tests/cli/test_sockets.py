"""Every socket a job listens on is on loopback when the job is on one machine (issue 17): the agent's two
stores (torch's TCPStore would listen on every interface: cluster/torchrun.py's _stores_on_their_address),
and the workers' Gloo pairs. Seen from /proc while the job runs: the LISTEN rows of /proc/PID/net/tcp{,6} (the
process's network namespace) whose socket inodes belong to the launcher or one of its descendants.
(A rehearsal's nodes in network namespaces: tests/cli/test_rehearse.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from spawn_ranks import free_port

from scaletrain.cluster.torchrun import _bind_address, _descendants, _stores_on_their_address

ME = [sys.executable, "-m", "scaletrain"]
RUN = ["--train.progress=false", "--train.eval_batches=1", "--log.every=100"]
LOOPBACK = {"127.0.0.1", "::1"}

pytestmark = pytest.mark.skipif(not os.access("/proc/net/tcp", os.R_OK), reason="needs Linux's /proc/net/tcp")


def _address(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" (little-endian 32-bit words) as ("127.0.0.1", 8080)."""
    addr, port = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def _listening(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of ``pid``'s network namespace (this machine's, unless it runs in another):
    inode -> (address, port)."""
    found = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # gone, or no IPv6
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A":  # TCP_LISTEN
                found[int(cols[9])] = _address(cols[1])
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listeners_of(pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of each listening socket these processes hold, each seen in its own network
    namespace."""
    found = set()
    for pid in pids:
        table = _listening(pid)
        found |= {(pid, *table[inode]) for inode in _socket_inodes(pid) if inode in table}
    return found


def _watch(commands: list[list[str]], tmp: Path) -> set[tuple[int, str, int]]:
    """Start the commands (one job's agents), collect their processes' listeners until all have exited; all
    must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # the launcher must set it itself
    env["OMP_NUM_THREADS"] = "1"
    logs = [(tmp / f"agent{i}.log").open("w") for i in range(len(commands))]
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env) for cmd, log in zip(commands, logs)]
    seen: set[tuple[int, str, int]] = set()
    deadline = time.monotonic() + 300  # a guard against a hung job, not a measurement
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            pids = [pid for p in procs for pid in (p.pid, *_descendants(p.pid))]
            seen |= _listeners_of(pids)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp / f"agent{i}.log").read_text()[-3000:]
    return seen


def test_a_two_rank_job_listens_on_loopback_only(tmp_path: Path) -> None:
    seen = _watch([[*ME, "train", "digits", "--nproc", "2", "--train.max_steps=120", f"--run.dir={tmp_path / 'run'}",
                    *RUN]], tmp_path)
    # The agent's rendezvous store and workers' store, and each worker's Gloo listener: 4 (3 at least, so
    # that seeing nothing cannot pass).
    assert len({(addr, port) for _, addr, port in seen}) >= 3, seen
    assert {addr for _, addr, _ in seen} <= LOOPBACK, seen


def test_two_agents_on_loopback_listen_on_loopback_only(tmp_path: Path) -> None:
    """A multi-node job rehearsed on one machine (two agents meeting at 127.0.0.1:PORT): both agents find
    the endpoint is theirs; the first to bind hosts the rendezvous store, the other joins it as a client."""
    port = free_port()
    agent = [*ME, "train", "digits", "--nproc", "1", "--nnodes", "2", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--dist.rdzv_id=sockets-{os.getpid()}", "--train.max_steps=100", f"--run.dir={tmp_path / 'run'}", *RUN]
    seen = _watch([agent, agent], tmp_path)
    assert ("127.0.0.1", port) in {(addr, p) for _, addr, p in seen}, seen  # the rendezvous store, on its endpoint
    assert len({(addr, p) for _, addr, p in seen}) >= 3, seen
    assert {addr for _, addr, _ in seen} <= LOOPBACK, seen


def test_a_store_listens_on_the_address_it_is_advertised_at() -> None:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d

    with _stores_on_their_address():
        store = c10d.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=5))
        mine = {(addr, port) for _, addr, port in _listeners_of([os.getpid()])}
        assert ("127.0.0.1", store.port) in mine and ("0.0.0.0", store.port) not in mine
        assert ("::", store.port) not in mine
        with pytest.raises(RuntimeError, match="in use"):  # torch's c10d backend then joins as a client
            c10d.TCPStore("127.0.0.1", store.port, is_master=True, timeout=timedelta(seconds=5))
        client = c10d.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
        client.set("k", "v")
        assert store.get("k") == b"v"
        del client, store
    assert c10d.TCPStore is TCPStore  # put back


def test_bind_address_is_an_address_never_a_name() -> None:
    assert [_bind_address(h) for h in ("127.0.0.1", "localhost", "[::1]", "::1", "10.0.0.7", "node0")] == [
        "127.0.0.1", "127.0.0.1", "::1", "::1", "10.0.0.7", None]


def test_a_machine_of_a_multi_node_job_gives_torchrun_its_configured_address():
    """dist.local_addr (scaletrain launch --local-addr): torchrun's --local-addr, where the workers' store of the
    machine hosting it listens (the wrapper above binds an address given as one); a local job keeps loopback."""
    from scaletrain.cluster.torchrun import torchrun_args
    from scaletrain.config import DistConfig

    multi = torchrun_args(DistConfig(nnodes=2, rdzv_endpoint="10.0.0.1:29500", local_addr="10.0.0.2"), ["t.py"],
                          module=False, run_id="job")
    assert "--local-addr=10.0.0.2" in multi
    assert "--local-addr=127.0.0.1" in torchrun_args(DistConfig(local_addr="10.0.0.2"), ["t.py"], module=False,
                                                     run_id="job")
    assert not any(a.startswith("--local-addr") for a in
                   torchrun_args(DistConfig(nnodes=2, rdzv_endpoint="node0:29500"), ["t.py"], module=False,
                                 run_id="job"))


def test_the_interface_of_an_address_is_found_by_the_address() -> None:
    """dist.local_addr -> the interface Gloo's and NCCL's sockets use (cluster/torchrun.py's launch)."""
    from scaletrain.cluster.torchrun import interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here
    assert interface_of("node0") is None  # a name is not an address
