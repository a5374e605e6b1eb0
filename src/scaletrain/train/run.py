"""One run, start to end: runtime -> data -> job -> loop -> final weights and summary -> close."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from scaletrain import __version__, runtime
from scaletrain.config import Config, load
from scaletrain.data import Splits, build_splits, in_memory
from scaletrain.observe.console import Console
from scaletrain.observe.metrics import MetricsWriter, peak_memory_bytes, write_json
from scaletrain.runtime import Runtime
from scaletrain.train.job import Job, LossFn, ModelArg, build_job
from scaletrain.train.loop import Loop
from scaletrain.train.rundir import agree_run_dir


def _header(job: Job, splits: Splits, console: Console) -> None:
    cfg, rt, plan = job.cfg, job.rt, job.plan
    params = sum(p.numel() for p in job.module.parameters())
    n_eval = len(splits.eval) if splits.eval is not None else 0  # type: ignore[arg-type]
    where = f"{rt.backend} on {rt.device}" if rt.distributed else f"single process on {rt.device}"
    console.print(f"scaletrain {__version__} | torch {torch.__version__} | world {rt.world_size} ({where}) | "
                  f"run dir {cfg.run_dir}")
    console.print(f"model {type(job.module).__name__}: {params / 1e6:.3f}M parameters | data {cfg.data.source}: "
                  f"{len(splits.train)} train / {n_eval} held-out samples")  # type: ignore[arg-type]
    console.print(f"{plan.describe()} | {plan.steps_per_epoch} steps/epoch, {plan.total_steps} steps")
    lr = f"peak lr {plan.peak_lr:.4g}"
    if cfg.optim.scale_lr:
        lr += f" = {cfg.optim.lr:g} x {plan.global_batch}/{cfg.optim.base_batch} (linear scaling rule)"
    sched = cfg.schedule
    console.print(f"{lr} | {cfg.optim.name} | warmup {sched.warmup_steps} steps, then {sched.decay} | "
                  f"precision {cfg.train.precision}")


def _finish(job: Job, loop: Loop, wall_s: float) -> dict[str, Any]:
    rt, plan = job.rt, job.plan
    peak = torch.tensor([peak_memory_bytes(rt.device)], device=rt.device)
    if rt.distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    samples = job.step * plan.global_batch
    return {
        "steps": job.step, "samples": samples, "epochs": job.step / plan.steps_per_epoch,
        "world_size": rt.world_size, "global_batch": plan.global_batch, "accum_steps": plan.accum_steps,
        "peak_lr": plan.peak_lr, "wall_s": wall_s, "train_s": loop.train_time, "train_loss": loop.last_loss,
        "eval": loop.last_eval, "samples_per_s": samples / loop.train_time if loop.train_time else 0.0,
        "peak_mem_bytes": int(peak.item()), "device": str(rt.device), "backend": rt.backend,
        "params": sum(p.numel() for p in job.module.parameters()), "config_digest": job.cfg.digest(),
        "torch": torch.__version__, "scaletrain": __version__,
    }


def save_weights(job: Job, path: Path) -> None:
    """The bare model's weights (no DDP prefix; tied tensors stored once), written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_model(job.module, str(tmp),
                                 metadata={"config_digest": job.cfg.digest(), "step": str(job.step)})
    os.replace(tmp, path)


def _summary_table(summary: dict[str, Any], run_dir: Path, console: Console) -> None:
    rows = [("steps", f"{summary['steps']:,} ({summary['epochs']:.2f} epochs)"),
            ("samples", f"{summary['samples']:,}"),
            ("world size", f"{summary['world_size']} ({summary['backend']}, {summary['device']})"),
            ("effective batch", f"{summary['global_batch']:,}"),
            ("train loss", f"{summary['train_loss']:.4f}")]
    rows += [(f"eval {k}", f"{100 * v:.2f}%" if k == "accuracy" else f"{v:.4f}")
             for k, v in summary["eval"].items() if k in ("loss", "accuracy")]
    rows += [("throughput", f"{summary['samples_per_s']:,.0f} samples/s"),
             ("wall time", f"{summary['wall_s']:.1f} s"),
             ("peak memory / rank", f"{summary['peak_mem_bytes'] / 2**20:,.0f} MiB"),
             ("run dir", str(run_dir))]
    console.table("summary", rows)


def run(cfg: Config, *, splits: Splits | None = None, model: ModelArg = None,
        loss_fn: LossFn | None = None, rt: Runtime | None = None) -> dict[str, Any]:
    """Train as configured; returns the summary (the same dict on every rank)."""
    started = time.perf_counter()
    rt = rt or runtime.init(cfg.dist)
    writer = MetricsWriter(None)
    job: Job | None = None
    try:
        cfg = agree_run_dir(cfg, rt)
        splits = splits or build_splits(cfg.data, cfg.model)
        job = build_job(cfg, rt, splits, model, loss_fn)
        console = Console(rt.is_main, cfg.train.progress)
        run_dir = cfg.run_dir
        if rt.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
            writer = MetricsWriter(run_dir / "metrics.jsonl")
        _header(job, splits, console)
        loop = Loop(job, console, writer)
        loop.run()
        summary = _finish(job, loop, time.perf_counter() - started)
        if rt.is_main:
            save_weights(job, run_dir / "model.safetensors")
            write_json(run_dir / "summary.json", summary)
        _summary_table(summary, run_dir, console)
        return summary
    finally:
        writer.close()
        if job is not None:
            job.release()
        runtime.close(rt)


def fit(model: nn.Module | Callable[[], nn.Module], train_data: Any, *, eval_data: Any = None,
        loss_fn: LossFn | None = None, config: Config | Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """Train your own model on your own data, on one process or every rank of a torchrun job.

    ``model``: a module, or better its class (or any callable building it): it is then built after seeding
    from run.seed, so the same config gives the same initial weights on every run.
    ``train_data``/``eval_data``: a torch Dataset or (inputs, targets) as tensors or numpy arrays; without
    eval_data, data.val_fraction of the training data is held out. ``loss_fn(output, target)`` defaults to
    cross-entropy. ``config``: a Config, a mapping of dotted keys ({"optim.lr": 0.1}), or a recipe/TOML path.
    """
    if isinstance(config, Config):
        cfg = config
    elif isinstance(config, str):
        cfg = load(config, overrides={"data.source": "memory"})
    else:
        cfg = load(None, overrides={"data.source": "memory", **(config or {})})
    splits = in_memory(train_data, eval_data, cfg.data.val_fraction)
    return run(cfg, splits=splits, model=model, loss_fn=loss_fn)
