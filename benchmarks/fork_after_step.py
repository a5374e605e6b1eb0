"""How often a process forked right after a DDP backward hangs inside os.fork, with torch's own Python comm hook
(allreduce_hook) against scaletrain's (observe/timing.py attach_comm_hook: Gloo's threads keep the Python thread
state a bucket's callback was given). A DataLoader starting its worker processes after a step is such a fork.

    python benchmarks/fork_after_step.py [--nproc 2] [--forks 3000] [--layers 8] [--json F]

Each rank runs a backward through a DDP model of --layers small Linear layers (a bucket each), then forks a
child that exits at once, --forks times per hook; a child not gone within 2 s is counted hung (its stack, read
with gdb where there is one, is in CPython's PyOS_AfterFork_Child) and killed. Started by hand it launches the
ranks through torchrun; rank 0 reports the sum over ranks. The hang is a race, so counts vary run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain import runtime
from scaletrain.config import DistConfig


def hung_forks(model: nn.Module, forks: int) -> int:
    """Children that had not exited 2 s after a fork made right after a backward."""
    x = torch.randn(8, 64)
    hung = 0
    for _ in range(forks):
        model(x).sum().backward()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 2.0
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.0005)
    return hung


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine [2]")
    p.add_argument("--forks", type=int, default=3000, help="forks per rank and hook [3000]")
    p.add_argument("--layers", type=int, default=8, help="Linear(64, 64) layers, one DDP bucket each [8]")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    if not runtime.under_launcher():
        from scaletrain.cluster.torchrun import launch

        raise SystemExit(launch(DistConfig(nproc=args.nproc), [__file__, *sys.argv[1:]], run_id="fork-bench"))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.observe.timing import StepTimer, attach_comm_hook

    torch.set_num_threads(1)
    rt = runtime.init(DistConfig(device="cpu"))
    counts = {}
    try:
        for name in ("torch allreduce_hook", "scaletrain"):
            torch.manual_seed(0)
            model = DistributedDataParallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(args.layers)]),
                                            bucket_cap_mb=0.01)
            if name == "scaletrain":
                attach_comm_hook(model, StepTimer(torch.device("cpu")))
            else:
                model.register_comm_hook(None, allreduce_hook)
            hung = torch.tensor([hung_forks(model, args.forks)])
            dist.all_reduce(hung)
            counts[name] = int(hung)
    finally:
        runtime.close(rt)
    if not rt.is_main:
        return
    total = args.forks * rt.world_size
    for name, hung in counts.items():
        print(f"{name}: {hung} of {total:,} children forked right after a backward hung")
    if args.json:
        from scaletrain.bench.report import environment

        Path(args.json).write_text(json.dumps({"environment": environment(), "nproc": rt.world_size,
                                               "forks": total, "layers": args.layers, "hung": counts}, indent=1))


if __name__ == "__main__":
    main()
