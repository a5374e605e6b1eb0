"""What ``--checkpoint.preempt_check=step`` costs per step: the host time of waiting for the previous step's
non-blocking all-reduce of the preemption flag and starting the next, on a Gloo group of its own, exactly
as the loop does it (Loop._preempted_now), between steps of a stand-in DDP step: matmuls on one thread,
then a blocking all-reduce of --grad-mb of "gradients" on the default group, which keeps the ranks in step
as DDP does (without it the flag's wait would be where a slower rank is waited for).

    python benchmarks/preempt_check_cost.py [--nproc 2] [--steps 2000] [--compute-ms 5] [--grad-mb 1] [--json F]

The default (``log``) costs nothing per step: the flag rides the log step's gather.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        a = torch.randn(256, 256)
        started = time.perf_counter()
        for _ in range(20):
            a @ a
        per_matmul = (time.perf_counter() - started) / 20
        matmuls = max(1, round(args.compute_ms / 1000 / per_matmul))
        grads = torch.zeros(max(1, int(args.grad_mb * 2**20 / 4)))
        flag, work, spent, steps = torch.zeros(1, dtype=torch.int64), None, [], []
        for _ in range(args.steps):
            step_start = time.perf_counter()
            for _ in range(matmuls):
                a @ a
            dist.all_reduce(grads)
            t = time.perf_counter()
            if work is not None:
                work.wait()
                flag.item()
            flag.fill_(0)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
            now = time.perf_counter()
            spent.append(now - t)
            steps.append(now - step_start)
        assert work is not None
        work.wait()
        if rank == 0:
            skip = args.steps // 10  # warm-up
            Path(out).write_text(json.dumps({"check_s": spent[skip:], "step_s": steps[skip:]}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine [2]")
    p.add_argument("--steps", type=int, default=2000, help="steps timed, the first 10%% not counted [2000]")
    p.add_argument("--compute-ms", type=float, default=5.0, help="stand-in compute per step, ms [5]")
    p.add_argument("--grad-mb", type=float, default=1.0, help="gradients all-reduced per step, MB [1]")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.start_processes(_rank, args=(args.nproc, port, args, out), nprocs=args.nproc, start_method="spawn")
        found = json.loads(Path(out).read_text())
    check, step = found["check_s"], found["step_s"]
    med, mean, p99 = statistics.median(check), statistics.fmean(check), sorted(check)[int(0.99 * len(check))]
    step_med = statistics.median(step)
    print(f"{args.nproc} ranks, {len(check)} steps of ~{1000 * step_med:.2f} ms: the flag's all-reduce costs "
          f"median {1e6 * med:.0f} us, mean {1e6 * mean:.0f} us, p99 {1e6 * p99:.0f} us per step "
          f"({100 * mean / step_med:.1f}% of the median step, by the mean)")
    if args.json:
        from scaletrain.bench.report import environment

        Path(args.json).write_text(json.dumps({"environment": environment(), "nproc": args.nproc,
                                               "compute_ms": args.compute_ms, "grad_mb": args.grad_mb,
                                               "steps": len(check), "median_s": med, "mean_s": mean,
                                               "p99_s": p99, "step_median_s": step_med}, indent=1))


if __name__ == "__main__":
    main()
