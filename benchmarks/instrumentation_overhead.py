"""What per-rank phase timing costs: the same 2-rank DDP run with --log.phase_times on and off, interleaved.

    python benchmarks/instrumentation_overhead.py [--recipe gpt-stdlib] [--nproc 2] [--steps 120] [--rounds 5]
    python benchmarks/instrumentation_overhead.py --in-process --recipe digits --rounds 30 --steps 50
    python benchmarks/instrumentation_overhead.py --marks

Each run is a real `scaletrain train` (torchrun workers, Gloo on CPU, one thread per rank). Its step time is
read from metrics.jsonl (wall seconds per step of each log interval, the first interval dropped as warm-up),
the median over intervals; the reported number is the median over rounds. With timing on the loop reads the
clock at each phase boundary and DDP's all-reduce goes through a Python comm hook (the default all-reduce,
timed); off, neither. Target (issue 5): at most 1% of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.bench.report import environment


def one_run(recipe: str, nproc: int, steps: int, timing: bool, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "scaletrain", "train", recipe, "--nproc", str(nproc),
               f"--train.max_steps={steps}", "--log.every=10", "--train.eval_every=100000", "--train.eval_batches=1",
               f"--log.phase_times={'true' if timing else 'false'}", "--train.progress=false",
               f"--run.dir={run_dir}", *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in records if r["kind"] == "train"][1:]
        return statistics.median(times)


def in_process(recipe: str, blocks: int, steps: int) -> dict[str, list[float]]:
    """The marks alone, one process: the same job's steps timed in alternating blocks with the phase timer
    on and off (no collective, so no comm hook either way). Seconds per step of each block."""
    import time

    import torch

    from scaletrain.config import load
    from scaletrain.data import build_splits
    from scaletrain.observe.timing import NullTimer, StepTimer
    from scaletrain.runtime import init
    from scaletrain.train.run import open_stepper, step

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(recipe, {"dist.device": "cpu", "run.dir": str(Path(tmp) / "run"), "log.every": 1_000_000})
        job, batches = open_stepper(cfg, init(cfg.dist), build_splits(cfg.data, cfg.model))
        assert job.st is not None
        timers = {"on": StepTimer(job.rt.device), "off": NullTimer(job.rt.device)}
        for _ in range(steps):  # warm-up
            step(job, batches)
        out: dict[str, list[float]] = {"on": [], "off": []}
        for b in range(blocks):
            for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
                job.st.timer = timers[mode]
                job.st.timer.start()  # the session starts the next step's timing as the previous one ends
                started = time.perf_counter()
                for _ in range(steps):
                    step(job, batches)
                out[mode].append((time.perf_counter() - started) / steps)
                timers["on"].collect()
        job.st.close(finished=False)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt-stdlib")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--in-process", action="store_true", help="time the marks alone in one process instead")
    p.add_argument("--marks", action="store_true", help="time one step's worth of marks, nothing else")
    args, extra = p.parse_known_args()
    if args.marks:
        import time

        import torch

        from scaletrain.observe.timing import StepTimer

        timer, n = StepTimer(torch.device("cpu")), 100_000
        started = time.perf_counter()
        for _ in range(n):  # the marks train_step makes on a CPU with one micro-step
            timer.start()
            timer.host("data", 0.0)
            timer.mark("h2d")
            timer.backward_done()
            timer.mark("optim")
            timer.end()
        print(f"one step's phase marks: {1e6 * (time.perf_counter() - started) / n:.2f} us")
        return
    if args.in_process:
        blocks = in_process(args.recipe, args.rounds, args.steps)
        on, off = statistics.median(blocks["on"]), statistics.median(blocks["off"])
        print(f"{args.recipe}, one process, {args.rounds} alternating blocks of {args.steps} steps")
        print(f"step time, marks on: {1000 * on:.3f} ms; off: {1000 * off:.3f} ms; "
              f"overhead {100 * (on / off - 1):+.2f}% (target <= 1%)")
        if args.json:
            Path(args.json).write_text(json.dumps({"environment": environment(), "recipe": args.recipe,
                                                   "mode": "in-process", "seconds_per_step": blocks,
                                                   "overhead": on / off - 1}, indent=1))
        return
    results: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):  # alternate who goes first
            results[mode].append(one_run(args.recipe, args.nproc, args.steps, mode == "on", extra))
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"{args.recipe} on {args.nproc} ranks, {args.steps} steps x {args.rounds} interleaved rounds")
    print(f"step time, phase timing on:  {1000 * on:.3f} ms  (rounds: {[round(1000 * x, 2) for x in results['on']]})")
    print(f"step time, phase timing off: {1000 * off:.3f} ms  (rounds: {[round(1000 * x, 2) for x in results['off']]})")
    print(f"overhead: {100 * (on / off - 1):+.2f}% of step time (target <= 1%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "recipe": args.recipe,
                                               "nproc": args.nproc, "steps": args.steps, "seconds": results,
                                               "median_on": on, "median_off": off,
                                               "overhead": on / off - 1}, indent=1))


if __name__ == "__main__":
    main()
