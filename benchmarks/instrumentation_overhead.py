"""What per-rank phase timing costs: the same 2-rank DDP run with --log.phase_times on and off, interleaved.

    python benchmarks/instrumentation_overhead.py [--recipe gpt-stdlib] [--nproc 2] [--steps 120] [--rounds 5]

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt-stdlib")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    args, extra = p.parse_known_args()
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
