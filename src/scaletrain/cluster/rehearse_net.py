"""The rehearsal's network check, one process per rank (`python -m scaletrain.cluster.rehearse_net --out F`,
started by torchrun agents of a rehearsed multi-node job): who is where (rank, node, local rank, host, pid), and
the all-reduce bus bandwidth over the whole world and between the nodes' first ranks (the link a multi-node job's
gradients cross). Rank 0 writes it all to F as JSON."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain import runtime
from scaletrain.config import DistConfig


def _busbw(size_bytes: int, group: dist.ProcessGroup | None, n: int, iters: int) -> float:
    """all_reduce bus bandwidth (bytes/s: size x 2(n-1)/n over the median time) on ``group``."""
    t = torch.ones(size_bytes // 4)
    for _ in range(2):
        dist.all_reduce(t, group=group)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        started = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - started)
    return size_bytes * 2 * (n - 1) / n / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mb", type=float, default=16.0)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    rt = runtime.init(DistConfig(device="cpu"))
    try:
        me = [rt.rank, int(os.environ.get("GROUP_RANK", "0")), rt.local_rank, socket.gethostname(), os.getpid()]
        everyone: list = [None] * rt.world_size
        dist.all_gather_object(everyone, me)
        nodes = sorted({row[1] for row in everyone})
        leaders = sorted(row[0] for row in everyone if row[2] == 0)
        size = int(args.mb * 2**20)
        world_bw = _busbw(size, None, rt.world_size, args.iters)
        between = dist.new_group(leaders)  # every rank creates it; only its members use it
        node_bw = _busbw(size, between, len(leaders), args.iters) if rt.rank in leaders and len(leaders) > 1 else None
        bws: list = [None] * rt.world_size
        dist.all_gather_object(bws, node_bw)
        if rt.is_main:
            ranks = [{"rank": r, "node": n, "local_rank": lr, "host": h, "pid": pid} for r, n, lr, h, pid in everyone]
            Path(args.out).write_text(json.dumps({
                "world_size": rt.world_size, "nodes": len(nodes), "ranks": ranks, "size_bytes": size,
                "world_busbw": world_bw, "between_nodes_busbw": next((b for b in bws if b is not None), None),
                "backend": rt.backend}, indent=1))
    finally:
        runtime.close(rt)


if __name__ == "__main__":
    main()
