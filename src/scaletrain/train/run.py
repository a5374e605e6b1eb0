"""One run, start to end: runtime -> data -> job -> loop -> final weights and summary -> close."""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from scaletrain import __version__, runtime
from scaletrain.batch import BatchFn
from scaletrain.config import Config, load
from scaletrain.data import Splits, build_splits, eval_indices, in_memory
from scaletrain.errors import DiskFull, Reported, Stopped, TrainingFailed, install_excepthook
from scaletrain.observe.console import Console
from scaletrain.observe.goodput import describe, run_totals
from scaletrain.observe.memory import (
    device_capacity_bytes,
    fmt_bytes,
    model_state_bytes,
    oom_advice,
    peak_bytes,
)
from scaletrain.observe.metrics import MetricsWriter, peak_memory_bytes, write_json, write_whole
from scaletrain.observe.sinks import check_tensorboard
from scaletrain.observe.stragglers import bottleneck, phase_fractions
from scaletrain.observe.throughput import throughput
from scaletrain.parallel import units_line
from scaletrain.plan.actual import describe as describe_plan
from scaletrain.runtime import Runtime
from scaletrain.train.batching import plan_batches
from scaletrain.train.checkpointing import Resume, find_resume
from scaletrain.train.job import Job, LossFn, ModelArg, build_job
from scaletrain.train.loop import DONE, PREEMPTED, Loop
from scaletrain.train.precision import slow_here
from scaletrain.train.preempt import Interrupted, PreemptFlag, restart_line
from scaletrain.train.resume import config_changes, fitting, restore
from scaletrain.train.rundir import agree_run_dir
from scaletrain.train.services import WEIGHTS, RunServices, write_outputs
from scaletrain.train.state import dedupe, full_model_state, stored_once
from scaletrain.train.trace import Tracer


def _header(job: Job, splits: Splits, console: Console) -> None:
    cfg, rt, plan = job.cfg, job.rt, job.plan
    params = sum(p.numel() for p in job.module.parameters())
    n_eval = len(splits.eval) if splits.eval is not None else 0  # type: ignore[arg-type]
    where = f"{rt.backend} on {rt.device}" if rt.distributed else f"single process on {rt.device}"
    console.print(f"scaletrain {__version__} | torch {torch.__version__} | world {rt.world_size} ({where}) | "
                  f"run dir {cfg.run_dir}")
    name = type(job.module).__name__.removeprefix("FSDP")  # fully_shard renames the class
    console.print(f"model {name}: {params / 1e6:.3f}M parameters | data {cfg.data.source}: "
                  f"{len(splits.train)} train / {n_eval} held-out samples")  # type: ignore[arg-type]
    layout = job.strategy if rt.world_size > 1 or job.sharded else "single replica"
    units = units_line(job.module, cfg.parallel.fsdp_units, sharded=job.sharded,
                       blocks=cfg.memory.activation_checkpointing != "none" or cfg.train.compile)
    extras = [units] if units else []
    extras += [f"activation checkpointing {cfg.memory.activation_checkpointing}"] \
        if cfg.memory.activation_checkpointing != "none" else []
    extras += ["CPU offload"] if cfg.memory.cpu_offload and job.sharded else []
    console.print(f"parallel: {layout}" + (f" ({job.strategy_reason})" if cfg.parallel.strategy == "auto" else "")
                  + "".join(f" | {e}" for e in extras))
    console.print(f"{plan.describe()} | {plan.steps_per_epoch} steps/epoch, {plan.total_steps} steps")
    lr = f"peak lr {plan.peak_lr:.4g}"
    if cfg.optim.scale_lr:
        lr += f" = {cfg.optim.lr:g} x {plan.global_batch}/{cfg.optim.base_batch} (linear scaling rule)"
    sched = cfg.schedule
    console.print(f"{lr} | {cfg.optim.name} | warmup {sched.warmup_steps} steps, then {sched.decay} | "
                  f"precision {cfg.train.precision}")
    slow = slow_here(cfg.train.precision, rt.device)
    if slow:
        console.print(f"warning: {slow}")
    if n_eval:
        batch = cfg.data.eval_batch_size or cfg.data.batch_size
        chosen = len(eval_indices(n_eval, batch_size=batch, world=rt.world_size, max_batches=cfg.train.eval_batches))
        if chosen < n_eval:
            console.print(f"eval: {chosen:,} of {n_eval:,} held-out samples, spread over the split "
                          f"(train.eval_batches = {cfg.train.eval_batches} per rank); --train.eval_batches=0 "
                          "evaluates all of them")


def _plan_vs_actual(job: Job, splits: Splits, summary: dict[str, Any]) -> dict[str, Any]:
    """plan/actual.py's record for this run, on every rank (each returns the summary)."""
    from scaletrain.plan.actual import plan_vs_actual

    rt, plan = job.rt, job.plan
    rate = summary["samples_per_s"]
    return plan_vs_actual(job.cfg, splits.task, splits.info, *splits.train[0][:2], job.module, device=rt.device,
                          parallel=job.layout, batch_size=plan.batch_size, accum_steps=plan.accum_steps, flops=job.flops,
                          state=summary["mem"], peak_bytes=summary["peak_mem_bytes"],
                          step_s=plan.global_batch / rate if rate else None, mfu=summary.get("hfu", summary.get("mfu")))


def _finish(job: Job, loop: Loop, wall_s: float, startup_s: float) -> dict[str, Any]:
    rt, plan = job.rt, job.plan
    peak = torch.tensor([peak_memory_bytes(rt.device)], device=rt.device)
    if rt.distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    samples = job.step * plan.global_batch
    overall = samples / loop.train_time if loop.train_time else 0.0
    # Throughput and MFU in steady state: the log intervals after the warm-up (compile included).
    totals = loop.services.phase_totals
    steady, steady_rate, good = run_totals(loop.records, wall_s=wall_s, startup_s=startup_s, phase_totals=totals,
                                           eval_s=loop.eval_s, checkpoint_s=loop.checkpoint_s,
                                           earlier=loop.services.earlier)
    samples_per_s = overall if steady_rate is None else steady_rate
    rates = throughput(samples_per_s, flops=job.flops, tokens_per_sample=job.tokens_per_sample,
                       world_size=rt.world_size, peak=loop.peak_flops)
    if "mfu" in rates and job.cfg.memory.activation_checkpointing == "full":
        rates["hfu"] = rates["mfu"] * 4 / 3  # the hardware also recomputes each block's forward in backward
    fractions = phase_fractions(totals)
    return {
        "steps": job.step, "samples": samples, "epochs": job.step / plan.steps_per_epoch,
        "world_size": rt.world_size, "global_batch": plan.global_batch, "accum_steps": plan.accum_steps,
        "peak_lr": plan.peak_lr, "wall_s": wall_s, "train_s": loop.train_time, "train_loss": loop.last_loss,
        "eval": loop.last_eval, "samples_per_s": samples_per_s, **rates, "samples_per_s_overall": overall,
        "steady_state": steady, "goodput": good,
        "phase_frac": fractions,
        "bottleneck": bottleneck(loop.services.phase_totals, device=rt.device.type, num_workers=job.cfg.data.num_workers,
                                 bucket_mb=job.cfg.parallel.bucket_mb, precision=job.cfg.train.precision,
                                 compiled=job.cfg.train.compile,
                                 gpu_lead=statistics.median(loop.lead_fracs) if loop.lead_fracs else None),
        "stragglers": loop.services.stragglers.summary(),
        "peak_mem_bytes": int(peak.item()), "device": str(rt.device), "backend": rt.backend,
        "params": sum(p.numel() for p in job.module.parameters()), "config_digest": job.cfg.digest(),
        "skipped_steps": int(loop.skipped_seen), "mem": loop.last_mem, "strategy": job.strategy,
        "torch": torch.__version__, "scaletrain": __version__,
    }


def save_weights(job: Job, path: Path) -> None:
    """The bare model's weights (no DDP prefix; tied tensors stored once), written whole or not at all by
    rank 0. Every rank calls this: under FSDP the full weights are gathered from the shards first."""
    meta = {"config_digest": job.cfg.digest(), "step": str(job.step)}
    full = full_model_state(job.module, sharded=job.sharded)  # collective under FSDP
    if not job.rt.is_main:
        return
    if job.sharded:
        tensors, aliases = stored_once(job.module, full, sharded=True)
        write_whole(path, _nbytes(tensors), lambda tmp: safetensors.torch.save_file(
            tensors, str(tmp), metadata={**meta, "aliases": json.dumps(aliases)}))
    else:
        write_whole(path, _nbytes(dedupe(job.module.state_dict())[0]),
                    lambda tmp: safetensors.torch.save_model(job.module, str(tmp), metadata=meta))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def _memory_row(mem: dict[str, Any]) -> list[tuple[str, str]]:
    """Where rank 0's memory goes, counted from its live tensors (activations: the rest of a GPU's peak)."""
    if "params_bytes" not in mem:
        return []
    parts = [f"params {fmt_bytes(mem['params_bytes'])}", f"grads {fmt_bytes(mem['grads_bytes'])}",
             f"optimizer {fmt_bytes(mem['optim_bytes'])}"]
    if mem.get("activations_bytes"):
        parts.append(f"activations {fmt_bytes(mem['activations_bytes'])}")
    return [("memory (rank 0)", " + ".join(parts))]


def _summary_table(summary: dict[str, Any], run_dir: Path, console: Console) -> None:
    rows = [("steps", f"{summary['steps']:,} ({summary['epochs']:.2f} epochs)"),
            ("samples", f"{summary['samples']:,}"),
            ("world size", f"{summary['world_size']} ({summary['backend']}, {summary['device']})"),
            ("effective batch", f"{summary['global_batch']:,}"),
            ("train loss", f"{summary['train_loss']:.4f}")]
    rows += [(f"eval {k}", f"{100 * v:.2f}%" if k == "accuracy" else f"{v:.4f}")
             for k, v in summary["eval"].items() if k in ("loss", "accuracy")]
    rate = f"{summary['samples_per_s']:,.0f} samples/s"
    if "tokens_per_s" in summary:
        rate += f" ({summary['tokens_per_s']:,.0f} tokens/s)"
    steady = summary.get("steady_state")
    window = f"steady state, steps {steady['first_step']}-{steady['last_step']}" if steady else \
        "the whole run: one log interval, no steady state told apart"
    rows += [("throughput", f"{rate}, {window}")]
    if "mfu" in summary:
        mfu = f"{100 * summary['mfu']:.1f}%"
        if "hfu" in summary:
            mfu += f" (HFU {100 * summary['hfu']:.1f}% with activation checkpointing's recompute)"
        rows += [("MFU", mfu)]
    elif "flops_per_s" in summary:
        rows += [("model FLOP/s", f"{summary['flops_per_s'] / 1e9:,.1f} GFLOP/s (no peak known for this device)")]
    verdict = summary["bottleneck"]
    rows += [("bottleneck", f"{verdict['verdict']}: {verdict['evidence']}")]
    rows += [(f"straggler rank {s['rank']}",
              f"{s['host']}, {s['phase']}, +{1000 * s['slower_by_s']:.1f} ms/step in {s['intervals']} interval(s)")
             for s in summary["stragglers"]]
    rows += [("wall time", f"{summary['wall_s']:.1f} s"), ("time spent on", describe(summary["goodput"])),
             ("peak memory / rank", f"{summary['peak_mem_bytes'] / 2**20:,.0f} MiB"),
             *_memory_row(summary.get("mem", {})),
             *([("plan vs actual", describe_plan(summary["plan_vs_actual"]))] if "plan_vs_actual" in summary else []),
             ("run dir", str(run_dir))]
    console.table("summary", rows)
    console.print(f"bottleneck: {verdict['verdict']}; fix: {verdict['fix']}")


def _resumed(job: Job, loop: Loop, resume: Resume, console: Console, writer: MetricsWriter) -> None:
    """Load the checkpoint into the built job and say so, in one line (plus one per change)."""
    cfg, rt = job.cfg, job.rt
    trainer, rank_state = restore(job, resume, cfg.debug.skipped())
    loop.train_time, loop.last_loss = float(trainer.get("train_time_s", 0.0)), float(trainer.get("last_loss", "nan"))
    loop.load_rank_state(rank_state)  # the RNG last: nothing may draw from it between here and the loop
    loader = job.loader.state_dict()
    console.print(f"resumed from {resume.path}: step {job.step} of {job.plan.total_steps}, epoch "
                  f"{loader['epoch'] + 1}, {loader['cursor']:,} of {loader['size']:,} samples of the epoch done")
    if job.plan.note:
        console.print(f"resume: {job.plan.note}")
    if rank_state is None and "rng" not in cfg.debug.skipped():
        console.print(f"resume: the checkpoint was made with {resume.meta['world_size']} ranks; ranks without "
                      "saved state keep RNG seeded from run.seed + rank")
    changes = config_changes(resume.meta.get("config", ""), cfg)
    if changes:
        console.print(f"warning: the configuration differs from the checkpoint's: {'; '.join(changes)}")
    if cfg.debug.skipped():
        console.print(f"resume: NOT restored (debug.skip_restore): {', '.join(sorted(cfg.debug.skipped()))}")
    writer.write({"kind": "resume", "step": job.step, "path": str(resume.path),
                  "world_size_was": resume.meta["world_size"], "world_size": rt.world_size,
                  "global_batch_was": resume.meta["global_batch"], "global_batch": job.plan.global_batch})
    if job.tracer is not None:
        job.tracer.resumed(job)


def _job_and_resume(cfg: Config, rt: Runtime, build: Callable[..., Job], train_size: int,
                    console: Console) -> tuple[Job, Resume | None]:
    """The checkpoint to continue from (its hashes and contents checked by rank 0), the job built for it
    (``build(resume=its metadata)``), and the checkpoint checked against the job's model (train/resume.py
    fitting): one whose tensors do not fit, while an older one's do, gives way to the older one, and the job
    is built again if that changes its plan."""
    def warn(message: str) -> None:
        console.print(f"warning: {message}")

    resume = find_resume(cfg.checkpoint, cfg.run_dir, rt, warn)
    job = build(resume=resume.meta if resume else None)
    if resume is None:
        return job, None
    try:
        fits = fitting(job, resume, cfg.checkpoint, warn, cfg.debug.skipped())
    except BaseException:
        job.release()
        raise
    if fits.path != resume.path and plan_batches(cfg, rt.world_size, train_size, fits.meta) != job.plan:
        job.release()
        job = build(resume=fits.meta)
    return job, fits


def _out_of_memory(job: Job) -> TrainingFailed:
    """A CUDA out-of-memory on this rank, reported once: where the memory went and what to change."""
    rt, cfg = job.rt, job.cfg
    state = job.state_bytes or model_state_bytes(job.module, job.optimizer)
    peak = peak_bytes(rt.device)
    advice = oom_advice(state.with_activations(max(0, peak - state.model_state_bytes)),
                        capacity_bytes=device_capacity_bytes(rt.device, rt.local_world_size), strategy=job.strategy,
                        world_size=rt.world_size, batch_size=job.plan.batch_size, accum_steps=job.plan.accum_steps,
                        activation_checkpointing=cfg.memory.activation_checkpointing,
                        precision=cfg.train.precision)
    return TrainingFailed(f"out of memory on {rt.device} during step {job.step + 1} (peak {fmt_bytes(peak)})\n"
                          f"{advice}")


def _stopped(job: Job, loop: Loop, outcome: str) -> dict[str, Any]:
    reason = PreemptFlag.name(loop.stopped_by) if outcome == PREEMPTED else "chaos.interrupt_step"
    record = loop.services.stopped(job.step, reason)
    if reason == "SIGINT":  # Ctrl-C: the work is saved; now stop the caller too, as Ctrl-C does
        raise Interrupted(record)
    return {"stopped": outcome, **record, "steps": job.step, "world_size": job.rt.world_size}


def run(cfg: Config, *, splits: Splits | None = None, model: ModelArg = None,
        loss_fn: LossFn | None = None, rt: Runtime | None = None, batch_fn: BatchFn | None = None,
        started: float | None = None) -> dict[str, Any]:
    """Train as configured, resuming from the run directory's latest checkpoint if there is one; returns the
    summary (the same dict on every rank), or, when preempted, ``{"stopped": ..., "steps": ...}``. After
    Ctrl-C (SIGINT) it saves a checkpoint and raises preempt.Interrupted, a KeyboardInterrupt. ``started``:
    time.perf_counter() when the run began (the CLI: its process's start), for the wall time and its
    account; default now."""
    started = time.perf_counter() if started is None else started
    rt = rt or runtime.init(cfg.dist)
    job: Job | None = None
    services: RunServices | None = None
    preempt = PreemptFlag(f"[rank {rt.rank}] " if rt.world_size > 1 else "").install()
    try:
        if cfg.log.tensorboard:
            check_tensorboard()
        cfg = agree_run_dir(cfg, rt)
        console = Console(rt.is_main, cfg.train.progress)
        splits = splits or build_splits(cfg.data, cfg.model)
        build = functools.partial(build_job, cfg, rt, splits, model, loss_fn, batch_fn=batch_fn)
        job, resume = _job_and_resume(cfg, rt, build, len(splits.train), console)  # type: ignore[arg-type]
        run_dir = cfg.run_dir
        services = RunServices.open(cfg, rt, console, resume, started=started)
        if cfg.debug.trace:
            job.tracer = Tracer(run_dir, rt.rank)
            job.loader.track_indices = True
        loop = Loop(job, console, services, preempt=preempt)
        _header(job, splits, console)
        if (restarted := restart_line(rt, resume.step if resume else None)) is not None:
            console.print(restarted)  # after torchrun restarted the group: which worker failed, how, where
        if resume is not None:
            _resumed(job, loop, resume, console, services.writer)
        loop_started = time.perf_counter()
        try:
            outcome = loop.run()
        except torch.OutOfMemoryError as err:
            raise _out_of_memory(job) from err
        except RuntimeError as err:
            raise runtime.collective_failure(err, job.rt, job.step + 1, job.cfg.dist.timeout_s) from err
        services.settle(preempt)
        if outcome != DONE:
            return _stopped(job, loop, outcome)
        summary = _finish(job, loop, time.perf_counter() - started, loop_started - started)
        # The planner builds the model the config names; the comparison needs a step counted in this process.
        if cfg.log.plan_vs_actual and model is None and "params_bytes" in summary["mem"]:
            summary["plan_vs_actual"] = _plan_vs_actual(job, splits, summary)
        write_outputs(job.step, services.checkpointer, [
            (WEIGHTS, lambda: save_weights(job, run_dir / WEIGHTS)),
            *([("summary.json", lambda: write_json(run_dir / "summary.json", summary))] if rt.is_main else [])])
        _summary_table(summary, run_dir, console)
        return summary
    except DiskFull as err:  # metrics.jsonl, or a final save at a stop: say what stays the latest checkpoint
        if services is None:
            raise
        raise services.disk_full(err) from None
    finally:
        preempt.uninstall()
        try:
            if services is not None:
                services.close()  # a save in flight completes even when training failed
        finally:
            if job is not None:
                if job.tracer is not None:
                    job.tracer.close()
                job.release()
            runtime.close(rt)


def fit(model: nn.Module | Callable[[], nn.Module], train_data: Any, *, eval_data: Any = None,
        loss_fn: LossFn | None = None, config: Config | Mapping[str, Any] | str | None = None,
        batch_fn: BatchFn | None = None) -> dict[str, Any]:
    """Train your own model on your own data, on one process or every rank of a torchrun job.

    ``model``: a module, or better its class (or any callable building it): it is then built after seeding
    from run.seed, so the same config gives the same initial weights on every run.
    ``train_data``/``eval_data``: a torch Dataset or (inputs, targets) as tensors or numpy arrays; without
    eval_data, data.val_fraction of the training data is held out. A Dataset's samples may be tuples of any
    length (the last is the target), dicts (Hugging Face style: ``model(**batch)``, target ``labels``) or
    tensors; ``batch_fn(batch) -> (inputs, target)`` maps any other layout (scaletrain.batch).
    ``loss_fn(output, target)`` receives the model's output as it returned it (a tensor, tuple, dict or
    ModelOutput); by default the model's own ``loss`` if it computed one, else cross-entropy of its logits.
    ``config``: a Config, a mapping of dotted keys ({"optim.lr": 0.1}), or a recipe/TOML path.

    A scaletrain error that the caller does not catch ends the program as the CLI does: one line, exit code
    2 (1 when training failed), said once however many ranks raised it.
    """
    try:
        if isinstance(config, Config):
            cfg = config
        elif isinstance(config, str):
            cfg = load(config, overrides={"data.source": "memory"})
        else:
            cfg = load(None, overrides={"data.source": "memory", **(config or {})})
        splits = in_memory(train_data, eval_data, cfg.data.val_fraction)
        return run(cfg, splits=splits, model=model, loss_fn=loss_fn, batch_fn=batch_fn)
    except (Reported, Stopped):
        install_excepthook()
        raise
