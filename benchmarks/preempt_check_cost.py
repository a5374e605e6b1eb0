"""What ``--checkpoint.preempt_check=step`` costs per step: the host time of StepAgreement.poll, the call the
loop makes at every step boundary (wait for the previous boundary's non-blocking all-reduce of the
preemption flag, start the next, on a Gloo group of its own), between stand-in DDP steps: matmuls on one
thread, then a blocking all-reduce of --grad-mb of "gradients" on the default group, which keeps the ranks in
step as DDP does (without it the flag's wait would be where a slower rank is waited for).

    python benchmarks/preempt_check_cost.py [--nproc 2] [--steps 2000] [--compute-ms 5] [--grad-mb 1] [--json F]

Started by hand it launches the ranks through torchrun, as the trainer does; rank 0 reports. The default
(``log``) costs nothing per step: the flag rides the log step's gather.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain import runtime
from scaletrain.config import DistConfig
from scaletrain.train.preempt import StepAgreement


def measure(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """(seconds in poll, seconds per step) of every step after the first 10%."""
    a = torch.randn(256, 256)
    started = time.perf_counter()
    for _ in range(20):
        a @ a
    matmuls = max(1, round(args.compute_ms / 1000 / ((time.perf_counter() - started) / 20)))
    grads = torch.zeros(max(1, int(args.grad_mb * 2**20 / 4)))
    agreement = StepAgreement(timeout_s=300)
    spent, steps = [], []
    for _ in range(args.steps):
        step_start = time.perf_counter()
        for _ in range(matmuls):
            a @ a
        dist.all_reduce(grads)
        t = time.perf_counter()
        agreement.poll(0)
        now = time.perf_counter()
        spent.append(now - t)
        steps.append(now - step_start)
    agreement.close()
    skip = args.steps // 10  # warm-up
    return spent[skip:], steps[skip:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine [2]")
    p.add_argument("--steps", type=int, default=2000, help="steps timed, the first 10%% not counted [2000]")
    p.add_argument("--compute-ms", type=float, default=5.0, help="stand-in compute per step, ms [5]")
    p.add_argument("--grad-mb", type=float, default=1.0, help="gradients all-reduced per step, MB [1]")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    if not runtime.under_launcher():
        from scaletrain.cluster.torchrun import launch

        raise SystemExit(launch(DistConfig(nproc=args.nproc), [__file__, *sys.argv[1:]],
                                run_id="preempt-check-bench"))
    torch.set_num_threads(1)
    rt = runtime.init(DistConfig(device="cpu"))
    try:
        check, step = measure(args)
    finally:
        runtime.close(rt)
    if not rt.is_main:
        return
    med, mean, p99 = statistics.median(check), statistics.fmean(check), sorted(check)[int(0.99 * len(check))]
    step_med = statistics.median(step)
    print(f"{rt.world_size} ranks, {len(check)} steps of ~{1000 * step_med:.2f} ms: the flag's all-reduce costs "
          f"median {1e6 * med:.0f} us, mean {1e6 * mean:.0f} us, p99 {1e6 * p99:.0f} us per step "
          f"({100 * mean / step_med:.1f}% of the median step, by the mean)")
    if args.json:
        from scaletrain.bench.report import environment

        Path(args.json).write_text(json.dumps({"environment": environment(), "nproc": rt.world_size,
                                               "compute_ms": args.compute_ms, "grad_mb": args.grad_mb,
                                               "steps": len(check), "median_s": med, "mean_s": mean,
                                               "p99_s": p99, "step_median_s": step_med}, indent=1))


if __name__ == "__main__":
    main()
