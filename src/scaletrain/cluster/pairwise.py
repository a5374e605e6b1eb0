"""Pairwise bandwidth between the machines of a job, before step 0: which node or which link is slow.

One machine slower than the others sets the pace of every collective, so N machines run at its speed; a
world all-reduce only shows the sum of it. Here the first rank of each machine (its local rank 0) exchanges
a buffer with every other machine's, both ways at once, in rounds of disjoint pairs (a round-robin
tournament: N-1 rounds for N machines, N for an odd N), while the other ranks wait at a barrier. The result
is a symmetric N x N matrix of bytes/s; ``find_slow`` reads it.

Used by `scaletrain doctor --nodes N` (run on every machine: ``run_check`` starts this module as the workers
through torchrun's API) and, with ``--dist.check_network=true``, once by the trainer's ranks after the
process group forms (runtime.init). Gloo on CPU, NCCL on GPUs: whatever backend the group has.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

# A link or node below this fraction of its peers' median is slow. Repeated TCP measurements between healthy
# machines of one cluster differ by 10-30% (other jobs' traffic, the scheduler); the faults worth naming cost
# a factor of 2 or more: a NIC that negotiated a lower speed (100 -> 50 or 25 Gb/s), a node behind another
# switch or an oversubscribed uplink, RDMA that fell back to TCP. Half sits between the two.
SLOW_RATIO = 0.5
SIZE_BYTES = 16 * 2**20  # per transfer, each way: large enough that bandwidth, not latency, dominates
ITERS = 5  # timed exchanges per pair (the median counts), after one untimed (connection set-up)

# Test hook (tests/cli/test_doctor_nodes.py): seconds this machine's first rank sleeps inside every timed
# exchange, a stand-in for a slow NIC. Read by nothing else.
SLOW_HOOK_ENV = "SCALETRAIN_TEST_SLOW_LINK_S"


# ------------------------------------------------------------------------------------------- the finding


@dataclass(frozen=True)
class Slow:
    """A slow node (``nodes`` = (i,)) or link (``nodes`` = (i, j)): its bandwidth and that of its peers."""

    kind: Literal["node", "link"]
    nodes: tuple[int, ...]
    hosts: tuple[str, ...]
    gb_per_s: float  # the node's links' median, or the link's (GB/s, 1e9 bytes/s)
    others_gb_per_s: float  # the median it is compared with

    def line(self) -> str:
        where = [f"node {n} ({h})" for n, h in zip(self.nodes, self.hosts)]
        if self.kind == "node":
            return (f"slow node: {where[0]}: its links {self.gb_per_s:.2f} GB/s, the other links' median "
                    f"{self.others_gb_per_s:.2f} GB/s; fix: check that machine's network (its NIC's link speed: "
                    "ethtool IFACE; the interface NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME picks), or leave it out")
        return (f"slow link: {where[0]} <-> {where[1]}: {self.gb_per_s:.2f} GB/s, their other links' median "
                f"{self.others_gb_per_s:.2f} GB/s; fix: check the path between the two (switch ports, cables, "
                "routes)")


def _links(matrix: list[list[float | None]]) -> dict[tuple[int, int], float]:
    n = len(matrix)
    return {(i, j): float(matrix[i][j]) for i in range(n) for j in range(i + 1, n)}  # type: ignore[arg-type]


def find_slow(matrix: list[list[float | None]], hosts: list[str], ratio: float = SLOW_RATIO) -> list[Slow]:
    """The slow nodes, then the slow links, in a symmetric matrix of bytes/s (node i <-> node j; the diagonal
    is not read). A node is slow when every link of it is below ``ratio`` x the median of the links that do
    not touch it (so it names a node slower than most, not half of the nodes); a link is slow when it is below
    ``ratio`` x the median of each end's other links, a slow node's links left out (it explains them).
    Nothing is named with fewer than 3 nodes: one link has no peers."""
    links = _links(matrix)
    n = len(matrix)
    if n < 3:
        return []
    found: list[Slow] = []
    for k in range(n):
        mine = [bw for pair, bw in links.items() if k in pair]
        others = statistics.median(bw for pair, bw in links.items() if k not in pair)
        if all(bw < ratio * others for bw in mine):
            found.append(Slow("node", (k,), (hosts[k],), statistics.median(mine) / 1e9, others / 1e9))
    slow_nodes = {s.nodes[0] for s in found}
    healthy = {pair: bw for pair, bw in links.items() if not slow_nodes & set(pair)}
    for (i, j), bw in healthy.items():
        ends = [[b for pair, b in healthy.items() if end in pair and pair != (i, j)] for end in (i, j)]
        if all(other and bw < ratio * statistics.median(other) for other in ends):
            found.append(Slow("link", (i, j), (hosts[i], hosts[j]), bw / 1e9,
                              statistics.median(ends[0] + ends[1]) / 1e9))
    return found


def even_line(matrix: list[list[float | None]]) -> str:
    """What to say when nothing is slow."""
    links = list(_links(matrix).values())
    if not links:
        return "one node: no link to measure"
    if len(links) == 1:
        return f"one link, {links[0] / 1e9:.2f} GB/s: nothing to compare it with (3 machines or more name a slow one)"
    return (f"network even: {len(links)} links {min(links) / 1e9:.2f}-{max(links) / 1e9:.2f} GB/s (median "
            f"{statistics.median(links) / 1e9:.2f}), none below {SLOW_RATIO:g}x its peers")


# ------------------------------------------------------------------------------------------- the measurement


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n nodes once, in rounds of disjoint pairs (the circle method; an odd n gives each node
    one round off)."""
    seats: list[int | None] = [*range(n), *([None] if n % 2 else [])]
    out = []
    for _ in range(len(seats) - 1):
        half = len(seats) // 2
        pairs = zip(seats[:half], reversed(seats[half:]))
        out.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return out


def _swap(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _exchange(peer: int, device: torch.device, size_bytes: int, iters: int) -> float:
    """Bytes/s each way between this rank and ``peer``, both sending at once: size over the median time."""
    buf = torch.ones(size_bytes // 4, device=device)
    inbox, tick, tock = torch.empty_like(buf), torch.zeros(1, device=device), torch.zeros(1, device=device)
    delay = float(os.environ.get(SLOW_HOOK_ENV, "0") or 0)
    times = []
    for _ in range(iters + 1):
        _swap(tick, tock, peer)  # both ends start together
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        if delay:
            time.sleep(delay)
        _swap(buf, inbox, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host-device sync: NCCL's transfers are asynchronous
        times.append(time.perf_counter() - started)
    return size_bytes / statistics.median(times[1:])


def measure(rank: int, local_rank: int, device: torch.device, *, size_bytes: int = SIZE_BYTES,
            iters: int = ITERS) -> dict[str, Any]:
    """Collective over the whole group (every rank calls it): the nodes (their first ranks in rank order,
    which under torchrun is node order) and the matrix of bytes/s between them, the slower end's view of
    each pair. The same on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, local_rank, socket.gethostname(), os.getpid(), os.getppid()))
    leaders = [row for row in sorted(everyone) if row[1] == 0]
    me = next((i for i, row in enumerate(leaders) if row[0] == rank), None)
    mine = {}
    for pairs in rounds(len(leaders)):
        for a, b in pairs:
            if me in (a, b):
                mine[(a, b)] = _exchange(leaders[b if me == a else a][0], device, size_bytes, iters)
        dist.barrier()
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    n = len(leaders)
    matrix: list[list[float | None]] = [[None] * n for _ in range(n)]
    for (a, b) in (pair for pairs in rounds(n) for pair in pairs):
        matrix[a][b] = matrix[b][a] = min(view[(a, b)] for view in seen if (a, b) in view)
    nodes = [{"node": i, "host": host, "rank": r, "pid": pid, "launcher_pid": ppid}
             for i, (r, _, host, pid, ppid) in enumerate(leaders)]
    return {"nodes": nodes, "bytes_per_s": matrix, "size_bytes": size_bytes, "iters": iters,
            "backend": dist.get_backend(), "device": device.type}


def report(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the findings: ``slow`` (one dict per slow node or link) and ``lines`` (what to say)."""
    hosts = [node["host"] for node in result["nodes"]]
    slow = find_slow(result["bytes_per_s"], hosts)
    lines = [s.line() for s in slow] or [even_line(result["bytes_per_s"])]
    return {**result, "slow": [vars(s) for s in slow], "lines": lines}


# ------------------------------------------------------------------------------------------- the launch


def run_check(nnodes: int, endpoint: str, nproc: int = 1) -> dict[str, Any]:
    """This machine's part of the check (every machine runs it, meeting at ``endpoint``): its workers
    started through torchrun's API; the report (``report``), or {"error": ...} when the workers failed."""
    from scaletrain.cluster.torchrun import launch
    from scaletrain.config import DistConfig

    cfg = DistConfig(nproc=nproc, nnodes=nnodes, rdzv_endpoint=endpoint)
    with tempfile.TemporaryDirectory(prefix="scaletrain-pairwise-") as tmp:
        out = Path(tmp) / "result.json"
        code = launch(cfg, ["scaletrain.cluster.pairwise", str(out)], module=True, run_id="scaletrain-doctor-nodes")
        if code != 0 or not out.is_file():
            return {"error": f"the check's workers failed (exit {code}); their output is above"}
        return report(json.loads(out.read_text(encoding="utf-8")))


def _worker_main(out: str) -> int:
    from scaletrain import runtime
    from scaletrain.config import DistConfig

    rt = runtime.init(DistConfig())
    try:
        result = measure(rt.rank, rt.local_rank, rt.device)
    finally:
        runtime.close(rt)
    if rt.local_rank == 0:  # one copy per machine, for that machine's launcher to print
        Path(out).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
