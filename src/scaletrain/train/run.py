"""scaletrain train and fit(): runtime -> data -> job -> a session that trains it -> final weights and summary."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain import __version__, runtime
from scaletrain.batch import IGNORE_INDEX, BatchFn
from scaletrain.checkpoint import rng
from scaletrain.config import Config
from scaletrain.data import Splits, Weighted, build_splits, eval_indices, in_memory, train_size
from scaletrain.errors import DiskFull, Reported, TrainingFailed, UserError, few, first_line, says_errors
from scaletrain.observe.console import Console
from scaletrain.observe.goodput import WARMUP_STEPS, describe, seconds
from scaletrain.observe.memory import (
    device_capacity_bytes,
    fmt_bytes,
    model_state_bytes,
    oom_advice,
    peak_bytes,
)
from scaletrain.observe.report.load import EVAL_OWN
from scaletrain.observe.sinks import check_tensorboard
from scaletrain.observe.throughput import per_second
from scaletrain.parallel import units_line
from scaletrain.plan.actual import describe as describe_plan
from scaletrain.runtime import Runtime
from scaletrain.train.batching import plan_batches
from scaletrain.train.checkpointing import Resume, find_resume
from scaletrain.train.evaluate import evaluate
from scaletrain.train.job import (
    Job,
    LossFn,
    Metric,
    ModelArg,
    OnEval,
    OwnOptimizer,
    OwnScheduler,
    batches_of,
    build_job,
    checked_metrics,
    train_step,
)
from scaletrain.train.precision import slow_here
from scaletrain.train.preempt import Preempted, PreemptFlag, restart_line
from scaletrain.train.resume import config_changes, fitting
from scaletrain.train.rundir import agree_run_dir, release_run_dir
from scaletrain.train.session import Opened, Session, check_workers, loaders_read, resolve_config

PREEMPTED, INTERRUPTED = "preempted", "interrupted"


def _count(dataset: Any) -> str:
    size = train_size(dataset)
    if isinstance(dataset, Weighted):
        return f"{len(dataset)} train ({size} drawn by weight per epoch)"
    return "a training stream" if size is None else f"{size} train"


def _trainable(trainable: int, params: int) -> str:
    """How many of a model's parameters train, where some are frozen: "1,536 trainable (5.4%)"."""
    count = f"{trainable:,}" if trainable < 1e6 else f"{trainable / 1e6:.3f}M"
    return f"{count} trainable ({100 * trainable / params:.2g}%)"


def _optimizer_line(job: Job) -> str:
    """The peak lr, the optimizer and the schedule, as the config or fit()'s optimizer= and scheduler= set them."""
    cfg, plan = job.cfg, job.plan
    scale = f" x {plan.global_batch}/{cfg.optim.base_batch} (linear scaling rule)" if cfg.optim.scale_lr else ""
    if job.own_optimizer is None:
        lr, opt = f"peak lr {plan.peak_lr:.4g}" + (f" = {cfg.optim.lr:g}{scale}" if scale else ""), cfg.optim.name
    else:  # the lr of each of its groups: as given (scaled when optim.scale_lr is on), or as its schedule has it now
        groups = job.optimizer.param_groups
        lrs = [g["lr"] for g in groups] if job.own_scheduler is not None else job.peak_lrs
        lr = ", ".join(sorted({f"{lr:.4g}" for lr in lrs}, key=float))
        lr = f"lr {lr} now" if job.own_scheduler is not None else f"peak lr {lr} (the optimizer's own{scale})"
        opt = f"{type(job.optimizer).__name__} (given), {len(groups)} parameter group{'s' * (len(groups) != 1)}"
    if job.own_scheduler is not None:
        return f"{lr} | {opt} | schedule {type(job.scheduler).__name__} (given)"
    sched = cfg.schedule
    return f"{lr} | {opt} | warmup {sched.warmup_steps} steps, then {sched.decay}"


def _header(job: Job, splits: Splits, console: Console) -> None:
    cfg, rt, plan, st = job.cfg, job.rt, job.plan, job.st
    assert st is not None  # attached: the session knows what is compiled (train.compile, or a model given so)
    params = job.params or sum(p.numel() for p in job.module.parameters())
    held = splits.eval
    stream = isinstance(held, torch.utils.data.IterableDataset)
    n_eval = 0 if held is None or stream else len(held)  # type: ignore[arg-type]
    where = f"{rt.backend} on {rt.device}" if rt.distributed else f"single process on {rt.device}"
    console.print(f"scaletrain {__version__} | torch {torch.__version__} | world {rt.world_size} ({where}) | "
                  f"run dir {cfg.run_dir}")
    name = job.model_name or type(job.module).__name__.removeprefix("FSDP")  # fully_shard renames the class
    frozen = f", {_trainable(job.trainable, params)}" if job.trainable < params else ""
    console.print(f"model {name}: {params / 1e6:.3f}M parameters{frozen} | data {cfg.data.source}: "
                  f"{_count(splits.train)} / {'a stream of' if stream else n_eval} held-out samples")
    layout = job.layout.describe() if rt.world_size > 1 or job.sharded else "single replica"
    units = units_line(job.module, cfg.parallel.fsdp_units, sharded=job.fsdp,
                       blocks=cfg.memory.activation_checkpointing != "none" or st.compiled)
    extras = [units] if units else []
    extras += [f"activation checkpointing {cfg.memory.activation_checkpointing}"] \
        if cfg.memory.activation_checkpointing != "none" else []
    extras += ["CPU offload"] if cfg.memory.cpu_offload and job.fsdp else []
    if (runner := job.pipeline) is not None:
        from scaletrain.parallel.pipeline import schedule_text

        extras.append(f"pipeline {schedule_text(runner.schedule, runner.virtual)}, {runner.microbatches} "
                      f"micro-batches of {plan.batch_size // runner.microbatches}: bubble (p - 1)/(v m + p - 1) = "
                      f"{100 * runner.planned_bubble:.1f}%")
    console.print(f"parallel: {layout}" + (f" ({job.strategy_reason})" if cfg.parallel.strategy == "auto" else "")
                  + "".join(f" | {e}" for e in extras))
    per_epoch = f"{plan.steps_per_epoch} steps/epoch" if plan.steps_per_epoch else "a stream, read in its order"
    console.print(f"{plan.describe()} | {per_epoch}, {plan.total_steps} steps")
    console.print(f"{_optimizer_line(job)} | precision {cfg.train.precision}")
    if job.unused and job.fsdp and not cfg.parallel.find_unused:
        console.print(_unused_line(job))
    slow = slow_here(cfg.train.precision, rt.device)
    if slow:
        console.print(f"warning: {slow}")
    target = job.first.target if job.first is not None else None
    if cfg.train.loss_mean == "micro_batch" and not job.user_loss and (plan.accum_steps > 1 or job.layout.dp_size > 1) \
            and isinstance(target, torch.Tensor) and not target.is_floating_point() and bool((target == IGNORE_INDEX).any()):
        console.print("warning: the first sample's targets hold -100 (left out of the loss), and each micro-batch's "
                      "loss is the mean over its own targets: a micro-batch of few targets weighs as much as one of "
                      "many; --train.loss_mean=tokens weighs every target of the step alike")
    if n_eval:
        batch = cfg.data.eval_batch_size or cfg.data.batch_size
        chosen = len(eval_indices(n_eval, batch_size=batch, world=job.layout.dp_size,
                                  max_batches=cfg.train.eval_batches))
        if chosen < n_eval:
            console.print(f"eval: {chosen:,} of {n_eval:,} held-out samples, spread over the split "
                          f"(train.eval_batches = {cfg.train.eval_batches} per {plan.readers}); "
                          "--train.eval_batches=0 "
                          "evaluates all of them")


def _unused_line(job: Job) -> str:
    """What FSDP does with the parameters the first sample left without a gradient (Job.unused)."""
    n = len(job.unused)
    got = f"{n} parameter{'s' * (n != 1)} got no gradient from the first sample ({few(list(job.unused))})"
    if job.zero_unused:
        return (f"note: {got}: each step reduce-scatters a zero gradient for a parameter a rank's batch leaves "
                "without one, as --parallel.find_unused=true does, so that ranks using different parameters (a "
                "mixture of experts) reduce alike")
    return (f"warning: {got}, and FSDP in torch {torch.__version__} reduce-scatters only the gradients a rank has: "
            "ranks whose batches use different parameters (a mixture of experts) would stop at a mismatched "
            "collective; fix: freeze them, or --parallel.strategy=ddp --parallel.find_unused=true")


def _plan_vs_actual(job: Job, splits: Splits, summary: dict[str, Any], model_given: bool) -> dict[str, Any]:
    """plan/actual.py's record for this run, on every rank (each returns the summary)."""
    from scaletrain.plan.actual import plan_vs_actual
    from scaletrain.plan.estimate import OWN

    rt, plan = job.rt, job.plan
    rate = summary["samples_per_s"]
    module = job.module
    if job.pipeline is not None:  # the whole model's structure, on the meta device (this rank holds one stage)
        from scaletrain.models import build_model

        with torch.device("meta"):
            module = build_model(job.cfg.model, splits.task, splits.info)
    # a model of one's own: its first sample as fit() split it, its class to build it on fake tensors (a model
    # given built cannot be: the plan then has the model state only), and the loss_fn its step goes backward from
    own = {"build": job.build, **({"loss_fn": job.loss_fn} if job.user_loss else {})} if job.build else {}
    task, info, sample = (OWN, own, (job.first, None)) if model_given else \
        (splits.task, splits.info, splits.train[0][:2])
    cfg = job.cfg if job.own_optimizer is None else dataclasses.replace(  # an optimizer given: its state's kind
        job.cfg, optim=dataclasses.replace(job.cfg.optim, name=job.optim_kind))
    return plan_vs_actual(cfg, task, info, *sample, module, device=rt.device,
                          parallel=job.layout, batch_size=plan.batch_size, accum_steps=plan.accum_steps, flops=job.flops,
                          state=summary["mem"], peak_bytes=summary["peak_mem_bytes"],
                          step_s=plan.global_batch / rate if rate else None, mfu=summary.get("hfu", summary.get("mfu")))


def _summarize(job: Job, splits: Splits, model_given: bool) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What scaletrain train / fit() add to the session's summary: the batch plan, epochs, the training loss,
    the last evaluation, the parameter count, and plan vs actual."""
    def add(summary: dict[str, Any]) -> dict[str, Any]:
        plan, st = job.plan, job.st
        assert st is not None
        # where the loader is; a stream's: the passes completed (its length is known only once a pass ended)
        epochs = job.loader.inner.epochs_done if plan.steps_per_epoch else float(job.loader.epoch)
        summary.update({"samples": st.samples_drawn(), "epochs": epochs,
                        "global_batch": plan.global_batch, "accum_steps": plan.accum_steps, "peak_lr": plan.peak_lr,
                        "train_loss": st.last_metrics.get("loss", math.nan), "eval": job.last_eval,
                        "params": job.params, "trainable_params": job.trainable, "strategy": job.strategy})
        if job.pipeline is not None:
            summary["pipeline"] = _pipeline_record(job)
        if job.best_eval is not None and job.best_eval.stopped:
            summary["early_stop"] = {"step": st.steps, **job.best_eval.state_dict()}
        # The comparison needs a step counted in this process. The planner builds the model the config names, or a
        # model of one's own by the class (or function) fit() was given (plan/own.py's way).
        # Not for tensor or pipeline parallelism of a model of one's own: the planner splits the built-in models
        # only (plan_fit() says so), and its split of their blocks does not apply to another model's.
        split = job.layout.tp > 1 or job.layout.pp > 1
        if job.cfg.log.plan_vs_actual and "params_bytes" in summary["mem"] and not (model_given and split):
            try:
                summary["plan_vs_actual"] = _plan_vs_actual(job, splits, summary, model_given)
            except Exception as err:  # a model of one's own that fake tensors cannot build: the run's outputs first
                if not model_given or isinstance(err, Reported):
                    raise
                job.st.console.print(f"warning: plan vs actual not recorded: the model could not be measured on "
                                     f"fake tensors ({first_line(err)}); --log.plan_vs_actual=false skips it")
        return summary
    return add


def _pipeline_record(job: Job) -> dict[str, Any]:
    """The pipeline's bubble measured on every rank (busy / wall time over the steps after the first, which
    holds the schedule's set-up) beside (p - 1) / (m + p - 1), the same share by the formula. Collective."""
    import torch.distributed as dist

    runner = job.pipeline
    assert runner is not None
    times = runner.bubble()
    mine = [times.busy_s, times.wall_s] if times is not None else [0.0, 0.0]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    bubbles = [1 - busy / wall if wall > 0 else None for busy, wall in every]
    measured = [b for b in bubbles if b is not None]
    return {"pp": runner.pp, "schedule": runner.schedule, "microbatches": runner.microbatches,
            "virtual": runner.virtual, "bubble_formula": runner.planned_bubble,
            "bubble": sum(measured) / len(measured) if measured else None, "rank_bubble": bubbles}


def _pipeline_row(record: dict[str, Any]) -> list[tuple[str, str]]:
    if record["bubble"] is None:
        return []
    from scaletrain.parallel.pipeline import schedule_text

    known = [b for b in record["rank_bubble"] if b is not None]
    text = (f"pp {record['pp']}, {schedule_text(record['schedule'], record['virtual'])}, "
            f"{record['microbatches']} micro-batches: bubble "
            f"{100 * record['bubble']:.1f}% of the step measured (ranks {100 * min(known):.1f}-"
            f"{100 * max(known):.1f}%), (p - 1)/(v m + p - 1) = {100 * record['bubble_formula']:.1f}%")
    return [("pipeline", text)]


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
    rows += [(f"eval {k}", f"{v:.4f}") for k, v in summary["eval"].items() if k not in EVAL_OWN]
    if (stop := summary.get("early_stop")) is not None:
        said = f"at step {stop['step']:,}: best eval {stop['monitor']} {stop['best']:.4f} at step {stop['best_step']:,}"
        rows += [("early stop", said)]
    if (best := summary.get("best_checkpoint")) is not None:
        measured = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in best.items()
                             if k not in ("step", "path", "loaded"))
        rows += [("best checkpoint", f"step {best['step']:,}" + (f" ({measured})" if measured else "")
                  + f": {best['path']}" + ("; its weights loaded into the model" if best.get("loaded") else ""))]
    if summary["samples_per_s"] is None:  # a resumed run that had no step left to run: nothing was timed
        rows += [("throughput", "not measured: no step ran in this attempt")]
    else:
        rate = f"{per_second(summary['samples_per_s'])} samples/s"
        if summary.get("tokens_per_s") is not None:
            rate += f" ({per_second(summary['tokens_per_s'])} tokens/s)"
        steady = summary.get("steady_state")
        window = f"steady state, steps {steady['first_step']}-{steady['last_step']}" if steady else \
            f"the whole run: no log interval after the warm-up (the first interval, the first {WARMUP_STEPS} steps)"
        rows += [("throughput", f"{rate}, {window}")]
    if summary.get("mfu") is not None:
        mfu = f"{100 * summary['mfu']:.1f}%"
        if "hfu" in summary:
            mfu += f" (HFU {100 * summary['hfu']:.1f}% with activation checkpointing's recompute)"
        rows += [("MFU", mfu)]
    elif summary.get("flops_per_s") is not None:
        rows += [("model FLOP/s", f"{summary['flops_per_s'] / 1e9:,.1f} GFLOP/s (no peak known for this device)")]
    verdict = summary["bottleneck"]
    rows += [("bottleneck", f"{verdict['verdict']}: {verdict['evidence']}")]
    rows += [(f"straggler rank {s['rank']}",
              f"{s['host']}, {s['phase']}, +{1000 * s['slower_by_s']:.1f} ms/step in {s['intervals']} interval(s)")
             for s in summary["stragglers"]]
    good = summary["goodput"]
    wall = seconds(summary["wall_s"])
    if good.get("attempts", 1) > 1:  # the account below spans every attempt of the run: say both
        wall += f" this attempt; {seconds(good['wall_s'])} over its {good['attempts']} attempts"
    rows += [("wall time", wall), ("time spent on", describe(good)),
             ("peak memory / rank", f"{summary['peak_mem_bytes'] / 2**20:,.0f} MiB"),
             *_memory_row(summary.get("mem", {})),
             *(_pipeline_row(summary["pipeline"]) if "pipeline" in summary else []),
             *([("noise scale", summary["grad_noise_scale"]["reading"])] if "grad_noise_scale" in summary else []),
             *([("plan vs actual", describe_plan(summary["plan_vs_actual"]))] if "plan_vs_actual" in summary else []),
             ("run dir", str(run_dir))]
    console.table("summary", rows)
    console.print(f"bottleneck: {verdict['verdict']}; fix: {verdict['fix']}")


def _resumed(job: Job, st: Session, resume: Resume, console: Console) -> None:
    """Say what was restored, in one line (plus one per change)."""
    cfg, rt = job.cfg, job.rt
    assert job.loader is not None
    loader = job.loader.inner.state_dict()
    done = f"{loader['size']:,} samples of the epoch done" if "size" in loader else "the stream's pass read"
    console.print(f"resumed from {resume.path}: step {st.steps} of {job.plan.total_steps}, epoch "
                  f"{loader['epoch'] + 1}, {loader['cursor']:,} of {done}")
    if job.plan.note:
        console.print(f"resume: {job.plan.note}")
    if int(resume.meta["world_size"]) < rt.world_size and "rng" not in cfg.debug.skipped():
        was = int(resume.meta["world_size"])
        console.print(f"resume: the checkpoint was made with {was} rank{'s' if was != 1 else ''}; ranks without "
                      "saved state seed their RNG from run.seed + rank")
    changes = config_changes(resume.meta.get("config", ""), cfg)
    # keys fit()'s optimizer= and scheduler= stand in for: their changes change nothing
    unused = tuple(k for k, own in (("optim.", job.own_optimizer), ("schedule.", job.own_scheduler)) if own is not None)
    changes = [c for c in changes if not c.startswith(unused) or c.startswith(("optim.grad_clip", "optim.scale_lr",
                                                                                "optim.base_batch"))]
    if changes:
        console.print(f"warning: the configuration differs from the checkpoint's: {'; '.join(changes)}")
    if cfg.debug.skipped():
        console.print(f"resume: NOT restored (debug.skip_restore): {', '.join(sorted(cfg.debug.skipped()))}")
    st.writer.write({"kind": "resume", "step": st.steps, "path": str(resume.path),
                     "world_size_was": resume.meta["world_size"], "world_size": rt.world_size,
                     "global_batch_was": resume.meta["global_batch"], "global_batch": job.plan.global_batch})


def _job_and_resume(cfg: Config, rt: Runtime, build: Callable[..., Job], size: int | None,
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
    fits = fitting(job, resume, cfg.checkpoint, warn, cfg.debug.skipped())
    if fits.path != resume.path and plan_batches(cfg, rt.world_size, size, fits.meta) != job.plan:
        job = build(resume=fits.meta)
    return job, fits


def _out_of_memory(job: Job) -> TrainingFailed:
    """A CUDA out-of-memory on this rank, reported once: where the memory went and what to change."""
    rt, cfg, st = job.rt, job.cfg, job.st
    state = (st._state_bytes if st is not None else None) or model_state_bytes(job.module, job.optimizer)
    peak = peak_bytes(rt.device)
    advice = oom_advice(state.with_activations(max(0, peak - state.model_state_bytes)),
                        capacity_bytes=device_capacity_bytes(rt.device, rt.local_world_size), strategy=job.strategy,
                        world_size=rt.world_size, batch_size=job.plan.batch_size, accum_steps=job.plan.accum_steps,
                        activation_checkpointing=cfg.memory.activation_checkpointing,
                        precision=cfg.train.precision)
    snapshot = _memory_snapshot(cfg.run_dir, rt.rank)
    where = f"; the allocator's state is in {snapshot} (drag it onto pytorch.org/memory_viz)" if snapshot else ""
    return TrainingFailed(f"out of memory on {rt.device} during step {job.step + 1} (peak {fmt_bytes(peak)})"
                          f"{where}\n{advice}")


def _memory_snapshot(run_dir: Path, rank: int) -> Path | None:
    """The CUDA caching allocator's segments and blocks at the out-of-memory (torch.cuda.memory._snapshot), as
    RUN_DIR/oom-rank-N.pickle; None off CUDA, or where it cannot be written (the report must still be made)."""
    if not torch.cuda.is_available():
        return None
    path = run_dir / f"oom-rank-{rank}.pickle"
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception:  # noqa: BLE001 -- a private API of torch: the OOM report matters more than its attachment
        return None
    return path


def _evaluate(job: Job, console: Console) -> None:
    st = job.st
    assert st is not None and job.loader is not None
    with st.evaluating():
        metrics = evaluate(job)
        if job.on_eval is not None:  # the user's: sampling, logging elsewhere; counted as evaluation time
            # the random numbers it draws (a sampler's) are its own: training's go on as without it, so a
            # resume (whose checkpoint was taken before this evaluation) stays exact
            drawn = rng.capture(st.device)
            job.module.eval()
            try:
                with torch.no_grad():
                    job.on_eval(job.module, st.steps, dict(metrics))
            finally:
                job.module.train()
                rng.restore(drawn, st.device)
    job.last_eval, job.eval_step = metrics, st.steps
    epoch = job.loader.epoch + 1 if st.steps else 0
    st.writer.write({"kind": "eval", "step": st.steps, "epoch": epoch, **{f"eval_{k}": v for k, v in metrics.items()}})
    text = f"eval  @ step {st.steps} (epoch {epoch}) | loss {metrics['loss']:.4f}"
    if "accuracy" in metrics:
        text += f" | accuracy {100 * metrics['accuracy']:.2f}% ({metrics['correct']:.0f}/{metrics['count']:.0f})"
    text += "".join(f" | {name} {metrics[name]:.4f}" for name in job.metrics)
    console.print(text)
    stop = job.best_eval
    if stop is None:
        return
    # the same metrics on every rank: the same decisions
    if stop.saw(metrics, st.steps) and job.cfg.checkpoint.best:
        st.save_best(**{f"eval_{stop.monitor}": metrics[stop.monitor]})
    if stop.stopped:
        moved = "fallen below" if stop.mode == "min" else "risen above"
        console.print(f"early stop at step {st.steps}: the held-out {stop.monitor} has not {moved} {stop.best:.4f} "
                      f"(step {stop.best_step}) for {stop.since} evaluation{'s' if stop.since > 1 else ''} (train.early_stop = "
                      f"{stop.patience})")
        st.writer.write({"kind": "early_stop", "step": st.steps, "monitor": stop.monitor, "best": stop.best,
                         "best_step": stop.best_step, "evaluations_since": stop.since})


def _train(job: Job, console: Console) -> None:
    """Steps to the plan's end, evaluating at the start, every train.eval_every steps (default: each epoch)
    and at the end."""
    st, plan = job.st, job.plan
    assert st is not None and job.model is not None
    every = job.cfg.train.eval_every or plan.steps_per_epoch or plan.total_steps  # a stream: at the end
    job.model.train()
    if job.eval_data is not None and st.steps == 0:
        _evaluate(job, console)  # the untrained baseline, so every curve has its starting point
    batches = batches_of(job)
    while not st.done:
        with st.step():
            train_step(job, batches)
        if job.eval_data is not None and (st.steps % every == 0 or st.done):
            _evaluate(job, console)
            if job.best_eval is not None and job.best_eval.stopped:
                break
    if job.eval_data is not None and job.eval_step != st.steps:
        _evaluate(job, console)


def open_job(cfg: Config, rt: Runtime, splits: Splits, *, console: Console, preempt: PreemptFlag,
             model: ModelArg = None, loss_fn: LossFn | None = None, batch_fn: BatchFn | None = None,
             optimizer: OwnOptimizer | None = None, scheduler: OwnScheduler | None = None,
             metrics: Mapping[str, Metric] | None = None, started: float | None = None) -> Job:
    """The job built and attached to its session: the checkpoint to continue from chosen for the model built
    (train/resume.py fitting), the session opened on it, the model set up and restored. ``cfg``'s run dir
    is agreed already."""
    cfg = cfg.for_device(rt.device.type)  # once: the job, its session and the run dir's config see what runs
    build = functools.partial(build_job, cfg, rt, splits, model, loss_fn, batch_fn=batch_fn, optimizer=optimizer,
                              scheduler=scheduler, metrics=metrics)
    job, resume = _job_and_resume(cfg, rt, build, train_size(splits.train), console)
    st = Session(cfg, opened=Opened(rt, console, resume, preempt, job.layout,
                                    time.perf_counter() if started is None else started))
    st.caller_holds = isinstance(model, nn.Module)  # given built (torch.compile's too), not as a class
    try:
        job.attach(st)
    except BaseException:
        st.close(finished=False)
        raise
    return job


def open_stepper(cfg: Config, rt: Runtime, splits: Splits, **kwargs: Any) -> tuple[Job, Iterator[Any]]:
    """A job on its session and its batches, for benchmarks and tests that step the trainer by hand
    (``step(job, batches)``) and close it themselves (``job.st.close(finished=False)``)."""
    job = open_job(agree_run_dir(cfg, rt), rt, splits, console=Console(False), preempt=PreemptFlag(), **kwargs)
    assert job.model is not None
    job.model.train()
    return job, batches_of(job)


def step(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """One step of the trainer, as run() takes it: train_step inside the session's step."""
    assert job.st is not None
    with job.st.step():
        return train_step(job, batches)


def run(cfg: Config, *, splits: Splits | None = None, model: ModelArg = None,
        loss_fn: LossFn | None = None, rt: Runtime | None = None, batch_fn: BatchFn | None = None,
        optimizer: OwnOptimizer | None = None, scheduler: OwnScheduler | None = None,
        metrics: Mapping[str, Metric] | None = None, on_eval: OnEval | None = None,
        started: float | None = None, stop_raises: bool = False) -> dict[str, Any]:
    """Train as configured, resuming from the run directory's latest checkpoint if there is one; returns the
    summary (the same dict on every rank), or, when preempted, ``{"stopped": ..., "steps": ...}`` (with
    ``stop_raises``, as fit() has it: raises preempt.Preempted instead). After Ctrl-C (SIGINT) it saves a
    checkpoint and raises preempt.Interrupted, a KeyboardInterrupt. ``started``: time.perf_counter() when the
    run began (the CLI: its process's start), for the wall time and its account; default now. The steps run on
    a session (train/session.py), as a loop of one's own does."""
    started = time.perf_counter() if started is None else started
    rt = rt or runtime.init(cfg.dist)
    job: Job | None = None
    preempt = PreemptFlag(f"[rank {rt.rank}] " if rt.world_size > 1 else "").install()
    try:
        if cfg.log.tensorboard:
            check_tensorboard()
        cfg = agree_run_dir(cfg, rt)
        console = Console(rt.is_main, cfg.train.progress)
        splits = splits or build_splits(cfg.data, cfg.model)
        job = open_job(cfg, rt, splits, console=console, preempt=preempt, model=model, loss_fn=loss_fn,
                       batch_fn=batch_fn, optimizer=optimizer, scheduler=scheduler, metrics=metrics,
                       started=started)
        st = job.st
        assert st is not None
        job.on_eval = on_eval
        resume = st.resume
        _header(job, splits, console)
        if (restarted := restart_line(rt, resume.step if resume else None)) is not None:
            console.print(restarted)  # after torchrun restarted the group: which worker failed, how, where
        if resume is not None:
            _resumed(job, st, resume, console)
        st.summarize = _summarize(job, splits, model is not None)
        try:
            _train(job, console)
        except torch.OutOfMemoryError as err:
            raise _out_of_memory(job) from err
        except Preempted as stop:
            if stop_raises:
                raise
            outcome = INTERRUPTED if stop.record["reason"] == "chaos.interrupt_step" else PREEMPTED
            return {"stopped": outcome, **stop.record, "steps": stop.record["step"], "world_size": rt.world_size}
        summary = st.close()
        _summary_table(summary, cfg.run_dir, console)
        return summary
    except DiskFull as err:  # metrics.jsonl, or a final save at a stop: say what stays the latest checkpoint
        if job is None or job.st is None or job.st.services is None:
            raise
        raise job.st.services.disk_full(err) from None
    except RuntimeError as err:  # a collective that failed or timed out, in a step or before the first (agreeing
        # on the run directory, the resume, the layout): one line naming who did not answer
        step = job.st.steps + 1 if job is not None and job.st is not None and job.st._training else 0
        failure = runtime.collective_failure(err, rt, step, cfg.dist.timeout_s, cfg.run_dir)
        if failure is err:
            raise  # the user's own error (in forward, in a Dataset): its traceback as it was
        raise failure from err
    finally:
        preempt.uninstall()
        if job is not None and job.st is not None:
            job.st.close(finished=False)  # after a failure: a save in flight completes; nothing when closed
        else:
            # taken before the job failed to open: let it go (a library caller's process lives on)
            release_run_dir(cfg.run_dir)
            runtime.close(rt)


@says_errors
def fit(model: nn.Module | Callable[[], nn.Module], train_data: Any, *, eval_data: Any = None,
        loss_fn: LossFn | None = None, config: Config | Mapping[str, Any] | str | None = None,
        batch_fn: BatchFn | None = None, argv: list[str] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None, optimizer: OwnOptimizer | None = None,
        scheduler: OwnScheduler | None = None, metrics: Mapping[str, Metric] | None = None,
        on_eval: OnEval | None = None) -> dict[str, Any]:
    """Train your own model on your own data, on one process or every rank of a torchrun job.

    ``model``: a module, or better its class (or any callable building it): it is then built after seeding
    from run.seed, so the same config gives the same initial weights on every run.
    ``train_data``/``eval_data``: a torch Dataset, any map-style dataset a DataLoader takes (a list of samples,
    a Hugging Face datasets.Dataset), (inputs, targets) as tensors or numpy arrays, or a DataLoader (its dataset,
    sharded, with its batch size per rank, collate_fn, shuffle and workers as defaults); train_data may be a
    stream (an IterableDataset: train.max_steps, no held-out split), and so may eval_data (read whole from its
    start at each evaluation); without eval_data, data.val_fraction of the
    training data is held out (0: none, no evaluation). A Dataset's samples may be tuples of any
    length (the last is the target), dicts (Hugging Face style: ``model(**batch)``, target ``labels``) or
    tensors; ``batch_fn(batch) -> (inputs, target)`` maps any other layout (scaletrain.batch), the held-out
    batches' too, with gradients off (an augmentation of training batches only tests torch.is_grad_enabled()).
    ``collate_fn(samples) -> batch``: how a list of samples becomes a batch, as a DataLoader takes it (a padding
    collator such as transformers' DataCollatorWithPadding); by default scaletrain.batch.collate.
    ``loss_fn(output, target)`` receives the model's output as it returned it (a tensor, tuple, dict or
    ModelOutput); by default the model's own ``loss`` if it computed one, else cross-entropy of its logits.
    ``optimizer``: your own, in place of optim.name/lr/momentum/betas/weight_decay: a torch optimizer built on the
    model given (nanoGPT's ``model.configure_optimizers(...)``), or, for a model given as its class, a function of
    the trainable parameters returning one (``lambda params: torch.optim.AdamW(params, lr=6e-4)``). Under FSDP
    or tensor parallelism it is given the sharded parameters. optim.grad_clip still clips, and scaletrain's
    schedule (schedule.*) scales each group's lr as given, by the linear scaling rule too when optim.scale_lr is on.
    ``scheduler``: your own LR schedule in place of schedule.*: one built on that optimizer, or a function of
    the optimizer returning one (``lambda opt: get_cosine_schedule_with_warmup(opt, 100, 1000)``), stepped after
    every optimizer step and checkpointed with it.
    ``metrics``: held-out measures of your own beside the loss (and accuracy), each a function of the model's
    output and the target returning per-sample values (or their batch mean as a 0-dim tensor, weighed by the
    batch's samples): the metric is their mean over the whole held-out split
    (summed over ranks: exact at any world size), logged as eval_NAME and in the summary's ``eval``
    (``{"top5": lambda out, y: (out.topk(5, -1).indices == y[:, None]).any(-1)}``); train.monitor may name one.
    ``on_eval(model, step, metrics)``: called on every rank after each evaluation, the model in eval mode under
    torch.no_grad() (to sample from it, or log elsewhere; its time is counted as evaluation). Under FSDP the
    model's forward is collective: call it on every rank alike; under parallel.pp > 1 it is this rank's stage.
    ``config``: a Config, a mapping of dotted keys ({"optim.lr": 0.1}), or a recipe/TOML path.
    ``argv``: ``--section.key=value`` strings on top of it, as scaletrain.session() takes them; by default the
    command line's --section.key options (`scaletrain launch --nproc 2 my.py --parallel.strategy=fsdp` reaches
    the run; the script's own arguments are left to it); ``argv=[]``: none.

    Returns the run's summary (summary.json's record, the same dict on every rank), once training is done. A
    run stopped after saving its checkpoint (a preemption's SIGTERM, Slurm's SIGUSR1, Ctrl-C, chaos.interrupt_step)
    does not return: it raises scaletrain.errors.Stopped, which, uncaught, ends the program as the CLI's stop
    does, without a traceback (exit code 0, or 130 for Ctrl-C outside a launcher), so the code after fit()
    (saving the final model, a last evaluation) runs only when the training finished; the same command resumes.
    A scaletrain error that the caller does not catch ends the program as the CLI does: one line, exit code
    2 (1 when training failed), said once however many ranks raised it.
    """
    memory = {"data.source": "memory"}  # the data are the arguments, whatever a recipe or TOML file says
    train_data, eval_data, collate_fn, given, worker_init_fn = loaders_read(train_data, eval_data, collate_fn)
    cfg = resolve_config(config, argv, defaults={**given, **memory}, pinned=memory)
    check_workers(cfg)
    splits = in_memory(train_data, eval_data, cfg.data.val_fraction, collate_fn=collate_fn)
    splits.worker_init_fn = worker_init_fn
    checked_metrics(metrics)  # before anything starts
    if on_eval is not None and not callable(on_eval):
        raise UserError(f"fit(on_eval=...): a {type(on_eval).__name__} is not a function; fix: a function "
                        "(model, step, metrics) called after each evaluation")
    return run(cfg, splits=splits, model=model, loss_fn=loss_fn, batch_fn=batch_fn, optimizer=optimizer,
               scheduler=scheduler, metrics=metrics, on_eval=on_eval, stop_raises=True)
