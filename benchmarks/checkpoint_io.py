"""Checkpoint save and load speed for a ~1 GB training state, against plain torch.save / torch.load, and how
long the training loop is blocked per checkpoint with scaletrain's background writer.

    python benchmarks/checkpoint_io.py [--gb 1.0] [--repeats 3] [--sharded N] [--dir /tmp/ckpt-bench] [--json out.json]

The state is a stack of 4096 x 4096 linear layers (fp32) with AdamW's state after one step: parameters +
two moments, about --gb GB in all. Every method writes to the same disk, fsyncs (a checkpoint that is not on
disk is not a checkpoint), and is timed end to end; the methods are interleaved in each repeat and the
median is reported. Loads read files just written, so they come from the page cache: they measure
deserialisation and copying, not the disk.

- scaletrain sync: the Checkpointer with async_save=False (copy to host buffers, write safetensors, fsync,
  SHA-256 every file, manifest, rename);
- scaletrain async: the same, the loop blocked only for the copy; "save" is until the commit;
- torch.save: torch.save({"model", "optimizer"}) to one file + fsync; torch.load(weights_only=True);
- loads: scaletrain's verified read (every byte hashed as it is read) into the live model and optimizer.

With ``--sharded N`` the same state is sharded with FSDP2 over N Gloo processes on this machine and saved
through DCP, interleaved: scaletrain sync (every rank writes its shards, rank 0 hashes every file, writes
the manifest and renames), scaletrain async (DCP's async save; the loop is blocked while the shards are
copied to host memory; "save" is until rank 0 committed), and plain dcp.save (no manifest, no hashes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.bench.report import environment
from scaletrain.checkpoint import commit
from scaletrain.config import CheckpointConfig
from scaletrain.runtime import Runtime
from scaletrain.train.checkpointing import OPTIMIZER, Checkpointer, Resume, read_model, read_tree
from scaletrain.train.state import load_model_tensors, load_optimizer_tree, model_tensors, optimizer_tree


def build(gb: float, *, fsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The stack of linears and AdamW after one step; with ``fsdp``, every layer and the root sharded by
    fully_shard over the current process group first."""
    layers = max(1, round(gb * 1e9 / (3 * 4 * 4096 * 4096)))  # params + 2 AdamW moments, fp32
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not fsdp)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return n


def scaletrain_save(model: nn.Module, opt: torch.optim.Optimizer, run_dir: Path, step: int,
                    background: bool, ck: Checkpointer) -> tuple[float, float]:
    """(seconds the loop was blocked, seconds until committed)."""
    started = time.perf_counter()
    blocked = ck.save(step, model_tensors(model), optimizer_tree(model, opt), {"step": step}, {"x": step},
                      {"format": "full"}, background=background)
    ck.wait()
    return blocked, time.perf_counter() - started


def scaletrain_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    started = time.perf_counter()
    resume = Resume(path, commit.read_manifest(path))
    tensors, aliases = read_model(resume)
    load_model_tensors(model, tensors, aliases, str(path))
    load_optimizer_tree(model, opt, read_tree(resume, OPTIMIZER), str(path))
    return time.perf_counter() - started


def torch_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - started


def torch_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    started = time.perf_counter()
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return time.perf_counter() - started


def sharded(args: argparse.Namespace) -> None:
    """The --sharded benchmark. Started by hand, it launches N local workers through torchrun (as the
    trainer does) that run this script again; each worker is one FSDP rank, and rank 0 reports."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    from scaletrain import runtime
    from scaletrain.cluster.torchrun import launch
    from scaletrain.config import DistConfig
    from scaletrain.train.state import dedupe

    work = Path(args.dir)
    if not runtime.under_launcher():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            code = launch(DistConfig(nproc=args.sharded), [__file__, *sys.argv[1:]], run_id="checkpoint-io-bench")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(code)
    torch.set_num_threads(1)
    rt = runtime.init(DistConfig(device="cpu"))
    try:
        torch.manual_seed(0)
        model, opt = build(args.gb, fsdp=True)
        cks = {mode: Checkpointer(CheckpointConfig(every=1, keep=1, async_save=mode == "async"), work / mode, rt)
               for mode in ("sync", "async")}
        results: dict[str, list[float]] = {k: [] for k in ("sync_save", "async_blocked", "async_save", "dcp_save")}
        for step in range(1, args.repeats + 2):  # the first round warms the page cache and DCP's planner
            for mode, ck in cks.items():
                dist.barrier()
                started = time.perf_counter()
                blocked = ck.save_sharded(step, model, opt, {"step": step}, {"x": step}, {"format": "dcp"})
                ck.wait()
                dist.barrier()  # rank 0 committed: the save is done for everyone
                total = time.perf_counter() - started
                if mode == "async":
                    results["async_blocked"].append(blocked)
                results[f"{mode}_save"].append(total)
            dist.barrier()
            started = time.perf_counter()
            state, _ = dedupe(model.state_dict())
            tdcp.save({"model": state, "optim": opt.state_dict()["state"]},
                      storage_writer=tdcp.FileSystemWriter(str(work / "plain" / f"step-{step}"),
                                                           single_file_per_rank=True))
            dist.barrier()
            results["dcp_save"].append(time.perf_counter() - started)
            if rt.is_main:
                shutil.rmtree(work / "plain", ignore_errors=True)
        for ck in cks.values():
            ck.close()
        if rt.is_main:
            size = sum(p.to_local().numel() * 4 * 3 for p in model.parameters()) * rt.world_size
            report(args, f"training state: {size / 1e9:.2f} GB sharded over {rt.world_size} FSDP ranks (Gloo, one "
                   "thread each)", results, size,
                   {"sync_save": "scaletrain DCP save, sync", "async_save": "scaletrain DCP save, async",
                    "async_blocked": "  loop blocked, async", "dcp_save": "dcp.save (no manifest)"},
                   ranks=rt.world_size)
    finally:
        runtime.close(rt)


def report(args: argparse.Namespace, title: str, results: dict[str, list[float]], size: int,
           labels: dict[str, str], **extra: Any) -> None:
    """Print the medians (the warm-up round left out) as seconds and GB/s, the blocked share, and the JSON."""
    medians = {k: statistics.median(v[1:]) for k, v in results.items()}
    gb = size / 1e9
    print(f"{title}; median of {args.repeats} interleaved repeats after one warm-up round")
    print(f"{'':28s}{'seconds':>10s}{'GB/s':>8s}")
    for key, label in labels.items():
        print(f"{label:28s}{medians[key]:10.3f}{gb / medians[key]:8.2f}")
    ratio = medians["async_blocked"] / medians["sync_save"]
    print(f"blocked per checkpoint with async saving: {100 * ratio:.1f}% of a synchronous save (target <= 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "state_bytes": size, **extra,
                                               "repeats": args.repeats, "seconds": results,
                                               "medians": medians, "async_blocked_over_sync": ratio}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the training state in GB [1.0]")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians reported [3]")
    p.add_argument("--dir", default="/tmp/scaletrain-ckpt-bench", help="scratch directory (removed after)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--sharded", type=int, default=0, metavar="N",
                   help="shard the state with FSDP over N Gloo processes and save through DCP (0 = one process) [0]")
    args = p.parse_args()
    if args.sharded:
        sharded(args)
        return

    torch.manual_seed(0)
    model, opt = build(args.gb)
    size = state_bytes(model, opt)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    results: dict[str, list[float]] = {k: [] for k in ("sync_save", "async_blocked", "async_save", "torch_save",
                                                        "scaletrain_load", "torch_load")}
    try:
        sync_ck = Checkpointer(CheckpointConfig(every=1, keep=1, async_save=False), work / "sync", rt)
        async_ck = Checkpointer(CheckpointConfig(every=1, keep=1, async_save=True), work / "async", rt)
        for step in range(1, args.repeats + 2):  # the first round warms the page cache and the host buffers
            blocked, total = scaletrain_save(model, opt, work / "sync", step, False, sync_ck)
            results["sync_save"].append(total)
            blocked, total = scaletrain_save(model, opt, work / "async", step, True, async_ck)
            results["async_blocked"].append(blocked)
            results["async_save"].append(total)
            results["torch_save"].append(torch_save(model, opt, work / "plain.pt"))
            latest = commit.committed(work / "sync" / "checkpoints")[-1][1]
            results["scaletrain_load"].append(scaletrain_load(model, opt, latest))
            results["torch_load"].append(torch_load(model, opt, work / "plain.pt"))
        sync_ck.close()
        async_ck.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, f"training state: {size / 1e9:.2f} GB ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
           "parameters + AdamW moments)", results, size,
           {"sync_save": "scaletrain save, sync", "async_save": "scaletrain save, async",
            "async_blocked": "  loop blocked, async", "torch_save": "torch.save + fsync",
            "scaletrain_load": "scaletrain load (verified)", "torch_load": "torch.load"})


if __name__ == "__main__":
    main()
