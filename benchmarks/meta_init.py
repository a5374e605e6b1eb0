"""What building the model on the meta device saves each rank: its peak host memory (resident set) from start to
its part of the model ready, built whole in memory then split (as the trainer did before) against built on the
meta device, split, and only its part filled (models/init.py, as the trainer now does under FSDP, tensor and
pipeline parallelism). Both give the same weights (tests/dist/test_meta_init.py); each (way, layout) runs in fresh
processes, so each peak is its own.

    python benchmarks/meta_init.py [--layer 16] [--embd 1024] [--vocab 32000] [--json F]

CPU/Gloo, 2 ranks. On GPUs the same split decides the device memory a rank needs to start: the whole model
(fp32) on one device before FSDP shards it, or its part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

LAYOUTS = {"pp2": {"strategy": "ddp", "pp": 2}, "fsdp2": {"strategy": "fsdp"}, "tp2": {"strategy": "ddp", "tp": 2}}


def _rank(rank: int, world: int, port: int, way: str, layout: str, shape: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    from torch.distributed.tensor import DTensor

    from scaletrain import runtime
    from scaletrain.config import DistConfig, MemoryConfig, ParallelConfig
    from scaletrain.layout import resolve_layout
    from scaletrain.models import Llama
    from scaletrain.models.init import is_meta, materialize
    from scaletrain.parallel import parallelize

    rt = runtime.init(DistConfig(device="cpu"))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)
    started = time.perf_counter()
    cfg = ParallelConfig(**LAYOUTS[layout])
    torch.manual_seed(0)
    with torch.device("meta") if way == "meta" else torch.device("cpu"):
        model = Llama(shape["vocab"], 256, shape["layer"], shape["embd"] // 64, shape["embd"] // 128, shape["embd"])
    part = parallelize(model, torch.device("cpu"), world, cfg, compile=False,
                       layout=resolve_layout(cfg, MemoryConfig(), world))
    del model
    if is_meta(part):
        materialize(part, torch.device("cpu"))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in part.parameters())
    Path(out, f"{rank}.json").write_text(json.dumps({"peak_bytes": peak, "base_bytes": base, "seconds": seconds,
                                                     "local_params": local}))
    runtime.close(rt)


def _measure(way: str, layout: str, shape: dict) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(2, port, way, layout, shape, out), nprocs=2, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", type=int, default=16)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", default="")
    args = p.parse_args()
    shape = {"layer": args.layer, "embd": args.embd, "vocab": args.vocab}
    from scaletrain.models import Llama

    with torch.device("meta"):
        whole = sum(p.numel() for p in Llama(args.vocab, 256, args.layer, args.embd // 64, args.embd // 128,
                                             args.embd).parameters())
    print(f"Llama {whole / 1e6:.0f}M parameters ({4 * whole / 1e9:.2f} GB fp32), 2 ranks, CPU/Gloo")
    rows = []
    for layout in LAYOUTS:
        for way in ("memory", "meta"):
            ranks = _measure(way, layout, shape)
            peak = max(r["peak_bytes"] - r["base_bytes"] for r in ranks)
            rows.append({"layout": layout, "way": way, "peak_over_start_bytes": peak, "ranks": ranks})
            print(f"{layout:6s} built {'whole in memory' if way == 'memory' else 'on meta, part filled':22s}: "
                  f"peak {peak / 1e9:5.2f} GB over start per rank (max of 2), "
                  f"{max(r['seconds'] for r in ranks):5.1f} s, holds {ranks[0]['local_params'] / 1e6:.0f}M")
    if args.json:
        from scaletrain.bench.report import environment

        Path(args.json).write_text(json.dumps({"environment": environment([sys.executable, *sys.argv]),
                                               "params": whole, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
