"""``scaletrain bench scaling``: the recipe at each world size, and how close to linear it scales.

Each world size is a real ``scaletrain train RECIPE --nproc N`` run (bench/runs.py) with a fixed number of
intra-op threads per rank (default 1), so that N ranks use N x threads cores. Throughput is read from the
run's metrics.jsonl, the first log interval (warm-up) excluded.

- weak scaling: the per-rank batch stays fixed, so the global batch grows with N;
  efficiency(N) = (throughput(N) / N) / throughput(1), 1.0 being perfect.
- strong scaling: the global batch stays fixed (--train.global_batch; each rank's share shrinks as N grows,
  through fewer accumulation micro-steps); speedup(N) = throughput(N) / throughput(1), efficiency = speedup / N.

When the smallest world size is not 1, it is the baseline and throughput(1) is estimated as
throughput(base) / base. The exposed-communication share comes from summary.json's ``phase_frac["comm"]``
when the trainer records it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.bench.runs import TrainRun, run_training
from scaletrain.config import load
from scaletrain.errors import ConfigError
from scaletrain.observe.goodput import steady_state

RESERVED = ("train.max_steps", "train.log_every", "dist.nproc", "dist.nnodes", "dist.rdzv", "dist.max_restarts")


def run_overrides(recipe: str, nprocs: list[int], mode: str, steps: int, warmup: int,
                  overrides: Mapping[str, str]) -> dict[str, str]:
    """What every run gets: the user's overrides, the step counts, and (strong) the fixed global batch."""
    for key, value in overrides.items():
        if key.startswith(RESERVED):
            raise ConfigError(key, value, "a key the bench does not set itself (it sets train.max_steps and "
                              "train.log_every from --steps/--warmup, and the world from --nproc)",
                              "drop it; use --steps, --warmup or --nproc instead")
    cfg = load(recipe, cli_overrides=overrides)  # the recipe's mistakes show here, before any run starts
    _check_gpus(cfg.dist.device, max(nprocs))
    out = {**overrides, "train.max_steps": str(warmup + steps), "train.log_every": str(warmup),
           "train.progress": "false"}
    out.setdefault("train.eval_batches", "1")  # evaluation is not timed; keep it short
    if mode == "weak":
        if cfg.train.global_batch:
            raise ConfigError("train.global_batch", cfg.train.global_batch, "unset with --mode weak (weak "
                              "scaling keeps the per-rank batch fixed, so the global batch grows with the ranks)",
                              "drop --train.global_batch, or use --mode strong")
        return out
    b = cfg.data.batch_size
    per_step = b * math.lcm(*nprocs)
    global_batch = cfg.train.global_batch or per_step
    if global_batch % per_step:
        raise ConfigError("train.global_batch", global_batch, f"a multiple of data.batch_size x lcm(--nproc) = "
                          f"{b} x {math.lcm(*nprocs)} = {per_step}, so that every world size runs whole "
                          "micro-batches", f"--train.global_batch={per_step}")
    return {**out, "train.global_batch": str(global_batch)}


def _check_gpus(device: str, nproc: int) -> None:
    """On GPUs every rank needs its own (NCCL cannot run two ranks on one GPU)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise ConfigError("--nproc", nproc, f"at most {gpus} ranks on this machine's {gpus} GPU(s) (one GPU per "
                          "rank)", f"--nproc up to {gpus}, or --dist.device=cpu to scale on the CPU")


def measure(recipe: str, nprocs: list[int], overrides: Mapping[str, str], *, threads: int, runs_dir: Path,
            progress: Any = print) -> list[dict[str, Any]]:
    """One run per world size, in the order given; returns one result dict per run."""
    results = []
    for n in nprocs:
        run = run_training(recipe, n, runs_dir / f"nproc{n}", overrides, threads=threads)
        results.append(_result(run))
        progress(f"  {n} rank{'s' if n > 1 else ''}: {results[-1]['samples_per_s']:,.1f} samples/s "
                 f"({results[-1]['step_time_s'] * 1e3:.1f} ms/step, global batch {results[-1]['global_batch']})")
    return results


def _result(run: TrainRun) -> dict[str, Any]:
    steady = steady_state(run.records)
    summary = run.summary
    comm = (summary.get("phase_frac") or {}).get("comm")
    return {"nproc": run.nproc, "global_batch": summary["global_batch"], "accum_steps": summary.get("accum_steps"),
            **steady, "samples_per_s_per_rank": steady["samples_per_s"] / run.nproc, "comm_frac": comm,
            "peak_mem_bytes": summary.get("peak_mem_bytes"), "backend": summary.get("backend"),
            "device": summary.get("device"), "run_dir": str(run.run_dir)}


def add_efficiency(results: list[dict[str, Any]], mode: str) -> None:
    """Speedup and efficiency against the smallest world size (throughput(1) = its throughput / its N)."""
    base = min(results, key=lambda r: r["nproc"])
    one_rank = base["samples_per_s"] / base["nproc"]
    for r in results:
        speedup = r["samples_per_s"] / one_rank
        r["speedup"] = speedup
        r["efficiency"] = speedup / r["nproc"]  # weak: per-rank over 1 rank's; strong: speedup over N
        r["baseline_nproc"] = base["nproc"]
        r["mode"] = mode


def table(results: list[dict[str, Any]], mode: str, seq_len: int) -> tuple[list[str], list[list[str]]]:
    unit = "tokens/s" if seq_len else "samples/s"
    scale = seq_len or 1
    columns = ["ranks", "global batch", unit, f"{unit} per rank", "ms/step", "speedup", "efficiency",
               "exposed comm"]
    rows = [[str(r["nproc"]), str(r["global_batch"]), f"{r['samples_per_s'] * scale:,.0f}",
             f"{r['samples_per_s_per_rank'] * scale:,.0f}", f"{r['step_time_s'] * 1e3:.1f}", f"{r['speedup']:.2f}x",
             f"{r['efficiency']:.3f}", "n/a" if r["comm_frac"] is None else f"{100 * r['comm_frac']:.1f}%"]
            for r in results]
    return columns, rows


def plot(results: list[dict[str, Any]], path: str, title: str, seq_len: int) -> Path:
    from scaletrain.bench.report import line_plot

    scale = seq_len or 1
    ns = [r["nproc"] for r in results]
    measured = [r["samples_per_s"] * scale for r in results]
    one = results[0]["samples_per_s"] * scale / results[0]["speedup"]
    return line_plot(path, {"measured": (ns, measured)}, title=title, xlabel="ranks",
                     ylabel="tokens/s" if seq_len else "samples/s", xticks=(ns, [str(n) for n in ns]),
                     reference=(ns, [one * n for n in ns], "linear (efficiency 1.0)"))
