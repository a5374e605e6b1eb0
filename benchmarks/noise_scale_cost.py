"""What ``--log.grad_noise_scale`` costs a step: the same `scaletrain train` run with it off and on, alternated
over rounds (side by side, so the machine's drift hits both), each round's steady-state step time read from
summary.json; the median of the per-round ratios is the cost.

    python benchmarks/noise_scale_cost.py [--recipe gpt-stdlib] [--nproc 2] [--steps 60] [--rounds 5]
        [--json F] [--section.key=value ...]

What it adds to a step: one squared norm per DDP bucket (each rank's own gradient before the all-reduce) or
per FSDP unit (the reduce-scatter's input), and the square of the pre-clip norm the optimizer step computes
anyway; the sums stay on the device until the log step's gather.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _step_time(recipe: str, nproc: int, steps: int, on: bool, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "scaletrain", "train", recipe, "--nproc", str(nproc), f"--run.dir={run_dir}",
               f"--train.max_steps={steps}", "--log.every=10", "--train.progress=false", "--train.eval_every=0",
               "--train.eval_batches=1", f"--log.grad_noise_scale={str(on).lower()}", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return summary["global_batch"] / summary["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt-stdlib", help="recipe [gpt-stdlib]")
    p.add_argument("--nproc", type=int, default=2, help="ranks [2]")
    p.add_argument("--steps", type=int, default=60, help="steps per run; steady state after the first log interval [60]")
    p.add_argument("--rounds", type=int, default=5, help="off/on pairs [5]")
    p.add_argument("--json", default="", help="write the results here")
    args, extra = p.parse_known_args()
    off, on = [], []
    for i in range(args.rounds):  # alternate which goes first, so neither always runs on a warmer machine
        for flag in ((False, True) if i % 2 == 0 else (True, False)):
            (on if flag else off).append(_step_time(args.recipe, args.nproc, args.steps, flag, extra))
    ratios = [b / a for a, b in zip(off, on)]
    cost = statistics.median(ratios) - 1
    print(f"{args.recipe}, {args.nproc} ranks, {args.rounds} rounds: step {1000 * statistics.median(off):.1f} ms "
          f"off, {1000 * statistics.median(on):.1f} ms on; median per-round ratio {1 + cost:.4f} "
          f"({100 * cost:+.1f}% a step; rounds {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:
        from scaletrain.bench.report import environment

        Path(args.json).write_text(json.dumps({"environment": environment([sys.executable, *sys.argv]),
                                               "recipe": args.recipe, "nproc": args.nproc, "steps": args.steps,
                                               "step_s_off": off, "step_s_on": on, "ratios": ratios,
                                               "cost": cost}, indent=1))


if __name__ == "__main__":
    main()
