"""How long scaletrain takes to start: `scaletrain --help`, and a 1-step digits run on one process and on 2
local ranks (torchrun), start to exit, in seconds of wall time and of CPU (the command and every process it
waited for: the workers too). Most of a short run, and of the test suite, is this.

    python benchmarks/startup.py [--repeats 5] [--checkout LABEL=DIR ...] [--more] [--json out.json]

Each --checkout is a source tree (DIR/src goes first on PYTHONPATH, for the launcher and its workers), so two
commits can be measured side by side in one run, interleaved; the default is this checkout. Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaletrain.bench.report import environment

RUN = ["train", "digits", "--train.max_steps=1", "--train.progress=false"]
COMMANDS = {"--help": ["--help"], "1 process, 1 step": RUN, "2 ranks, 1 step": [*RUN, "--nproc", "2"]}
# --more: commands whose ranks are scaletrain's other modules (the doctor's 2-rank self-test, a 2 x 2 rehearsal:
# its network check, then 4 steps)
MORE = {"doctor": ["doctor"],
        "rehearsal 2 x 2": ["cluster", "rehearse", "--nodes", "2", "--nproc", "2", "digits", "--steps", "4"]}


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(src: Path, args: list[str], run_dir: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one command, start to exit."""
    env = {**os.environ, "PYTHONPATH": str(src / "src"), "OMP_NUM_THREADS": "1"}
    extra = [f"--run.dir={run_dir}"] if args and args[0] == "train" else \
        [f"--out={run_dir}"] if args and args[0] == "cluster" else []
    cpu, started = _children_cpu(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "scaletrain", *args, *extra], check=False, env=env,
                          capture_output=True, text=True)
    took, cpu = time.perf_counter() - started, _children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{src}: scaletrain {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return took, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians reported [5]")
    p.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                   help="a source tree to measure (repeatable) [this one]")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--more", action="store_true", help="also `scaletrain doctor` and a 2 x 2 rehearsal")
    args = p.parse_args()
    if args.more:
        COMMANDS.update(MORE)
    trees = dict(c.split("=", 1) for c in args.checkout) or {"this": str(Path(__file__).resolve().parents[1])}
    seconds: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    cpu: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for label, tree in trees.items():
                for i, (name, command) in enumerate(COMMANDS.items()):
                    run_dir = Path(tmp) / f"{label}-{round_}-{i}"
                    wall, used = timed(Path(tree), command, run_dir)
                    seconds[label][name].append(wall)
                    cpu[label][name].append(used)
    medians = {t: {c: statistics.median(v) for c, v in per.items()} for t, per in seconds.items()}
    cpu_medians = {t: {c: statistics.median(v) for c, v in per.items()} for t, per in cpu.items()}
    first = next(iter(trees))
    for what, table in (("seconds from start to exit", medians), ("CPU seconds, workers included", cpu_medians)):
        print(f"median of {args.repeats} interleaved rounds, {what}")
        print(f"{'':20s}" + "".join(f"{t:>14s}" for t in trees) + (f"{'ratio':>10s}" if len(trees) == 2 else ""))
        for name in COMMANDS:
            row = f"{name:20s}" + "".join(f"{table[t][name]:14.2f}" for t in trees)
            if len(trees) == 2:
                last = list(trees)[-1]
                row += f"{table[last][name] / table[first][name]:10.2f}"
            print(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment([sys.executable, *sys.argv]),
                                               "checkouts": trees, "repeats": args.repeats, "seconds": seconds,
                                               "medians": medians, "cpu_seconds": cpu, "cpu_medians": cpu_medians},
                                              indent=1))


if __name__ == "__main__":
    main()
