"""The same job four ways, interleaved: a hand-written DDP loop, Lightning Fabric, Hugging Face Accelerate and
scaletrain. Prints median step time and peak memory with ratios to the hand-written loop; --json keeps them.

    python benchmarks/peers/run.py --nproc 2 --steps 60 --rounds 5 [--device cpu|cuda] [--json peers.json]

Each round runs every implementation once, in the same order (A B C D A B C D ...), so that a machine that
drifts (thermals, a neighbour's load) drifts for all of them alike. Every run is a fresh torchrun job of
--nproc workers with --threads intra-op threads each, started the same way (`scaletrain launch` for the three
peers; `scaletrain train` for scaletrain, whose launcher is the same torchrun API). common.py defines the job
and the timing; an implementation's step time is the median over rounds of its run's median log interval.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common

from scaletrain.bench.report import environment, header_line, print_table, usable_cores, write_json
from scaletrain.bench.runs import RunFailed, run_training
from scaletrain.observe.goodput import steady_state

HERE = Path(__file__).resolve().parent
SCRIPTS = {"ddp": "ddp_loop.py", "fabric": "fabric_loop.py", "accelerate": "accelerate_loop.py"}
IMPLS = ("ddp", "fabric", "accelerate", "scaletrain")
NEEDS = {"fabric": "lightning", "accelerate": "accelerate"}  # installed by pip install -e '.[bench]'
LABELS = {"ddp": "hand-written DDP", "fabric": "Lightning Fabric", "accelerate": "HF Accelerate",
          "scaletrain": "scaletrain"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="2", help="ranks (world size); several (1,2) also give each one's weak "
                   "scaling efficiency [default: 2]")
    p.add_argument("--job", choices=("gpt-stdlib", "gpt2-124m", "digits"), default="gpt-stdlib",
                   help="the job all four run [default: gpt-stdlib]")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run [default: 60]")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps per timed interval; the first interval is warm-up [default: 10]")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds [default: 5]")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda where there is one, else cpu [default: auto]")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank [default: 1]")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"which to run, in order [default: {','.join(IMPLS)}]")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    args.impls = [s.strip() for s in args.impls.split(",")]
    try:
        args.nprocs = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        p.error(f"--nproc {args.nproc!r}: expected world sizes like 2 or 1,2")
    os.environ["SCALETRAIN_PEERS_JOB"] = args.job  # every process started from here runs this job
    importlib.reload(common)
    for impl in args.impls:
        if impl not in IMPLS:
            p.error(f"--impls: {impl!r} is not one of {', '.join(IMPLS)}")
        if impl in NEEDS and importlib.util.find_spec(NEEDS[impl]) is None:
            p.error(f"--impls: {impl} needs the package {NEEDS[impl]!r}; fix: pip install -e '.[bench]' "
                    f"(or leave {impl} out of --impls)")
    if args.steps < 2 * args.log_every:
        p.error(f"--steps {args.steps}: need at least 2 x --log-every = {2 * args.log_every} (one warm-up interval "
                "and one timed)")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def run_once(impl: str, args: argparse.Namespace, work: Path, round_: int, nproc: int) -> dict[str, Any]:
    env_threads = {"OMP_NUM_THREADS": str(args.threads)}
    if impl == "scaletrain":
        overrides = {**common.SCALETRAIN_OVERRIDES, "train.max_steps": args.steps, "train.log_every": args.log_every,
                     "train.eval_batches": 1, "train.progress": "false", "dist.device": args.device}
        run = run_training(args.job, nproc, work / f"scaletrain-{nproc}-{round_}", overrides, threads=args.threads)
        return {"records": run.records, "peak_mem_bytes": run.summary["peak_mem_bytes"]}
    out = work / f"{impl}-{nproc}-{round_}.json"
    log = work / f"{impl}-{nproc}-{round_}.log"
    command = [sys.executable, "-m", "scaletrain", "launch", "--nproc", str(nproc), str(HERE / SCRIPTS[impl]),
               "--steps", str(args.steps), "--log-every", str(args.log_every), "--device", args.device,
               "--out", str(out)]
    with log.open("w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env_threads},
                              check=False).returncode
    if code != 0:
        raise RunFailed(command, code, log)
    return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for impl, results in runs.items():
        medians = [steady_state(r["records"])["step_time_s"] for r in results]
        out[impl] = {"step_time_s": statistics.median(medians), "round_step_time_s": medians,
                     "peak_mem_bytes": statistics.median(r["peak_mem_bytes"] for r in results),
                     "final_loss": statistics.median(r["records"][-1]["loss"] for r in results)}
    return out


def _table(args: argparse.Namespace, nproc: int, summary: dict[str, dict[str, Any]]) -> None:
    ref = summary.get("ddp")
    rows = []
    for impl, s in summary.items():
        spread = f"{min(s['round_step_time_s']) * 1e3:.2f}-{max(s['round_step_time_s']) * 1e3:.2f}"
        rows.append([LABELS[impl], f"{s['step_time_s'] * 1e3:.2f}", spread,
                     f"{s['step_time_s'] / ref['step_time_s']:.3f}" if ref else "-",
                     f"{s['peak_mem_bytes'] / 2**20:,.0f}",
                     f"{s['peak_mem_bytes'] / ref['peak_mem_bytes']:.3f}" if ref else "-", f"{s['final_loss']:.4f}"])
    mem = "CUDA allocator peak" if args.device == "cuda" else "peak RSS"
    print_table(f"peers, {args.job}, {nproc} rank(s) on {args.device}", ["implementation", "ms/step (median)",
                "rounds' range", "vs hand-written", f"{mem} MiB", "vs hand-written", "final loss"], rows,
                caption=f"median over {args.rounds} rounds of each run's median log interval; memory: max over "
                "ranks, median over rounds; target: scaletrain <= 1.02 x the hand-written loop's step time")


def main() -> int:
    args = parse_args()
    env = environment([sys.executable, *sys.argv])
    print(header_line(env))
    print(f"peers: {args.job} job, {args.nproc} rank(s) on {args.device}, {args.threads} thread(s) per rank, "
          f"{common.BATCH} samples per rank per step, {args.steps} steps in intervals of {args.log_every} (first "
          f"one warm-up), {args.rounds} interleaved rounds of {', '.join(args.impls)}")
    if 1 in args.nprocs:
        print("note: at 1 rank scaletrain and the hand-written loop do not wrap the model in DDP (nothing to "
              "synchronise) while Fabric and Accelerate do: compare those at 2 ranks or more")
    if args.device == "cpu" and max(args.nprocs) * args.threads > usable_cores():
        print(f"note: {max(args.nprocs)} ranks x {args.threads} thread(s) exceed the {usable_cores()} cores here")
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {n: {impl: [] for impl in args.impls} for n in args.nprocs}
    with tempfile.TemporaryDirectory(prefix="scaletrain-peers-") as tmp:
        for round_ in range(args.rounds):
            for nproc in args.nprocs:
                for impl in args.impls:
                    try:
                        result = run_once(impl, args, Path(tmp), round_, nproc)
                    except RunFailed as err:
                        print(f"peers: {impl} failed: {err}", file=sys.stderr)
                        return 1
                    runs[nproc][impl].append(result)
                    step = steady_state(result["records"])["step_time_s"]
                    print(f"  round {round_ + 1}/{args.rounds} {nproc} rank(s) {impl:<10} {step * 1e3:8.2f} ms/step  "
                          f"peak {result['peak_mem_bytes'] / 2**20:,.0f} MiB")
    summaries = {n: summarize(r) for n, r in runs.items()}
    for nproc, summary in summaries.items():
        _table(args, nproc, summary)
    efficiency: dict[str, dict[int, float]] = {}
    if len(args.nprocs) > 1:
        base = min(args.nprocs)
        for impl in args.impls:
            # weak scaling: the per-rank batch is fixed, so efficiency = step time at base / step time at N
            efficiency[impl] = {n: summaries[base][impl]["step_time_s"] / summaries[n][impl]["step_time_s"]
                                for n in args.nprocs}
        rows = [[LABELS[impl], *(f"{efficiency[impl][n]:.3f}" for n in args.nprocs)] for impl in args.impls]
        print_table(f"weak scaling efficiency, {args.job}", ["implementation", *(f"{n} rank(s)" for n in args.nprocs)],
                    rows, caption=f"per-rank throughput at N over that at {base} (the per-rank batch is fixed)")
    if args.json:
        data = {"bench": "peers", "environment": env, "job": args.job, "nproc": args.nprocs, "device": args.device,
                "threads_per_rank": args.threads, "steps": args.steps, "log_every": args.log_every,
                "rounds": args.rounds, "batch_per_rank": common.BATCH,
                "summary": {str(n): s for n, s in summaries.items()}, "efficiency": efficiency,
                "runs": {str(n): r for n, r in runs.items()}}
        print(f"wrote {write_json(args.json, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
