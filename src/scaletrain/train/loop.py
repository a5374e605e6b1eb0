"""The step loop: micro-batches with no_sync, clip, the non-finite guard, optimizer, schedule; then, at their
intervals, log, evaluate and checkpoint.

The hot loop never waits on the device. The loss is summed into a device tensor; the non-finite decision is
made on the device (train/guard.py). Once per log interval (log.every) one all_gather brings every
rank's numbers to every rank: the loss, the non-finite counters and whether the rank was asked to stop
(SIGTERM/SIGUSR1). That is the only per-interval collective and host sync besides DDP's own all-reduce, so
every rank takes the same decisions at the same step. Checkpoint steps that are not log steps gather the
same numbers first: nothing is saved after a non-finite step under train.nonfinite=raise.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from scaletrain.checkpoint import rng
from scaletrain.errors import TrainingFailed
from scaletrain.observe.console import Console
from scaletrain.observe.memory import model_state_bytes, peak_bytes
from scaletrain.observe.throughput import device_peak, throughput
from scaletrain.observe.timing import PHASES
from scaletrain.parallel import gradient_sync
from scaletrain.train.checkpointing import (
    FORMAT_DCP,
    FORMAT_FULL,
    describe_versions,
)
from scaletrain.train.evaluate import evaluate
from scaletrain.train.guard import clipped_norm, nonfinite_where
from scaletrain.train.interval import RankReport, gather
from scaletrain.train.job import Job
from scaletrain.train.precision import autocast
from scaletrain.train.preempt import PreemptFlag
from scaletrain.train.services import RunServices
from scaletrain.train.state import model_tensors, optimizer_tree, scheduler_tree
from scaletrain.train.trace import Tracer

DONE, PREEMPTED, INTERRUPTED = "done", "preempted", "interrupted"


def _grad_norm(job: Job) -> torch.Tensor | None:
    """The total gradient norm (clipping to optim.grad_clip if set); None under fp16 without clipping."""
    return clipped_norm([p for p in job.module.parameters() if p.grad is not None], job.cfg.optim.grad_clip,
                        job.scaler, job.optimizer)


def train_step(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """One optimizer step over accum_steps micro-batches; returns the step's mean loss on the device."""
    rt, precision, chaos, tracer = job.rt, job.cfg.train.precision, job.chaos, job.tracer
    timer = job.timer
    accum, step = job.plan.accum_steps, job.step + 1
    timer.start()
    step_loss = torch.zeros((), device=rt.device)
    if tracer is not None:
        tracer.step_started(job)
    for micro in range(accum):
        waited = time.perf_counter()
        chaos.delay("data")
        batch = job.batcher(next(batches))
        timer.host("data", time.perf_counter() - waited)
        if tracer is not None:
            tracer.batch(job, batch)
        batch = batch.to(rt.device)
        timer.mark("h2d")
        # Only the last micro-step all-reduces (or reduce-scatters) gradients; the others accumulate locally.
        with gradient_sync(job.model, micro == accum - 1):
            with autocast(precision, rt.device, sharded=job.sharded):
                loss = chaos.poison(step, job.loss_fn(batch(job.model), batch.target)) / accum
            chaos.delay("compute")
            job.scaler.scale(loss).backward()
        timer.backward_done()
        step_loss += loss.detach()
    job.guard.watch_loss(step, step_loss)
    norm = _grad_norm(job)
    apply = job.guard.gate(step, job.optimizer, norm) if norm is not None else True
    if apply:
        job.scaler.step(job.optimizer)
    job.guard.disarm(job.optimizer)
    job.scaler.update()
    if job.state_bytes is None:  # gradients and optimizer state all exist now, once
        job.state_bytes = model_state_bytes(job.module, job.optimizer)
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    timer.mark("optim")
    timer.end()
    job.step += 1
    if tracer is not None:
        tracer.step_done(job, step_loss)
    return step_loss


class Loop:
    """Runs job.step .. plan.total_steps; keeps the log interval's running sums."""

    def __init__(self, job: Job, console: Console, services: RunServices | None = None, *,
                 preempt: PreemptFlag | None = None) -> None:
        self.job, self.console = job, console
        self.services = services or RunServices(job.cfg, job.rt, console)
        self.writer, self.checkpointer = self.services.writer, self.services.checkpointer
        self.preempt = preempt or PreemptFlag()
        self.train_time = 0.0  # seconds spent in training steps (eval excluded)
        self.last_loss = math.nan
        self.last_eval: dict[str, float] = {}
        self.eval_step = -1
        self.loss_sum = torch.zeros((), device=job.rt.device)  # this rank's finite losses since the last log
        self.loss_count = torch.zeros((), device=job.rt.device)  # how many there were
        self.since = 0  # steps since the last log step
        self.interval_s = 0.0  # at a save: seconds trained since the last log step (in train_time_s too)
        self.skipped_seen = 0.0
        self.stopped_by = 0  # the signal that stopped the run, if any
        self.last_mem: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []  # this process's log intervals: step, steps, step_time_s, samples_per_s
        self.eval_s = 0.0  # seconds this process spent evaluating
        self.checkpoint_s = 0.0  # seconds the loop was blocked by saves
        self.lead_fracs: list[float] = []  # GPU: per log interval, the median rank's lead_s over its step time
        _, self.peak_flops = device_peak(job.rt.device, job.cfg.train.precision, tf32=job.cfg.train.tf32)

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self) -> str:
        """Train to the end (DONE), or until preempted (PREEMPTED) or chaos.interrupt_step (INTERRUPTED),
        after saving a checkpoint."""
        job, plan = self.job, self.job.plan
        batches = iter(job.loader)
        job.model.train()
        if job.eval_data is not None and job.step == 0:
            self._evaluate()  # the untrained baseline, so every curve has its starting point
        self.console.start_progress(plan.total_steps, job.step)
        t0 = time.perf_counter()
        try:
            while job.step < plan.total_steps:
                job.chaos.before_step(job.step + 1)
                step_loss = train_step(job, batches)
                finite = torch.isfinite(step_loss)
                self.loss_sum += torch.where(finite, step_loss, 0.0)  # a skipped step's loss is not averaged in
                self.loss_count += finite
                self.since += 1
                self.preempt.tick()
                self.console.advance()
                stop = ""
                log_step = job.step % job.cfg.log.every == 0 or job.step == plan.total_steps
                if log_step:
                    elapsed = time.perf_counter() - t0
                    stop = self._log(self._gather(phases=True), elapsed)
                    t0 = time.perf_counter()
                if self._eval_due():
                    started = time.perf_counter()
                    self._evaluate()
                    t0 += time.perf_counter() - started  # eval time is not training time
                stop = stop or self._preempted_now()
                if job.chaos.interrupt_after(job.step):
                    stop = stop or INTERRUPTED
                ckpt = self.checkpointer
                if stop or (ckpt is not None and ckpt.due(job.step, plan.total_steps)):
                    if not log_step:  # the log step's gather already brought the counters
                        stop = self._check(self._gather(phases=False)) or stop
                    self.interval_s = time.perf_counter() - t0
                    blocked = self._save(final=bool(stop))
                    job.timer.add("ckpt", blocked)
                    self.checkpoint_s += blocked
                    t0 += blocked
                self.services.log_saves()
                if stop:
                    return stop
        finally:
            self.console.stop_progress()
        if job.eval_data is not None and self.eval_step != job.step:
            self._evaluate()
        return DONE

    def _preempted_now(self) -> str:
        """PREEMPTED when the ranks agree at this step boundary that one was signalled, without waiting for
        the log step (RunServices.stop_signal)."""
        signum = self.services.stop_signal(self.preempt)
        if signum:
            self.stopped_by = signum
            return PREEMPTED
        return ""

    # -- sync points --------------------------------------------------------------------------------------

    def _gather(self, *, phases: bool) -> list[RankReport]:
        """Every rank's RankReport (phase times only if ``phases``: collecting them starts a new interval),
        on every rank: train/interval.py's one all_gather and one host-device sync."""
        job = self.job
        times = job.timer.collect() if phases else [0.0] * len(PHASES)
        return gather(job.rt, {"loss": self.loss_sum, "loss_count": self.loss_count}, job.guard,
                      signal=self.preempt.signum, peak=peak_bytes(job.rt.device), times=times,
                      lead=job.timer.lead_s if phases else 0.0)

    def _check(self, rows: list[RankReport]) -> str:
        """Act on the gathered counters: stop for a non-finite step (train.nonfinite=raise), report skipped
        ones, and return PREEMPTED if any rank was signalled."""
        job = self.job
        skipped = max(r.skipped for r in rows)
        if skipped > self.skipped_seen:
            where = nonfinite_where([r.first_skipped for r in rows], [r.first_bad_loss for r in rows])
            if job.cfg.train.nonfinite == "raise":
                raise TrainingFailed(f"{where}; the step was not applied and nothing after it was saved; fix: "
                                     "lower --optim.lr, set --optim.grad_clip=1.0, more --schedule.warmup_steps, "
                                     "or --train.nonfinite=skip to skip such steps")
            self.console.print(f"warning: {where}: step skipped ({int(skipped)} skipped so far)")
            self.skipped_seen = skipped
        signals = [r.signal for r in rows if r.signal]
        if signals:
            self.stopped_by = signals[0]
            return PREEMPTED
        return ""

    def _log(self, rows: list[RankReport], elapsed: float) -> str:
        job = self.job
        steps = self.since
        counted = sum(r.sums["loss_count"] for r in rows)
        loss = sum(r.sums["loss"] for r in rows) / counted if counted else math.nan
        stop = self._check(rows)
        if not math.isfinite(loss) and job.cfg.train.nonfinite == "raise":
            raise TrainingFailed(f"loss is {loss} at step {job.step}; fix: lower --optim.lr, set "
                                 "--optim.grad_clip=1.0, or use more warmup (--schedule.warmup_steps)")
        self.train_time += elapsed
        self.last_loss = loss
        samples_per_s = steps * job.plan.global_batch / elapsed
        self.records.append({"step": job.step, "steps": steps, "step_time_s": elapsed / steps,
                             "samples_per_s": samples_per_s})
        record = {"kind": "train", "step": job.step, "epoch": job.loader.epoch + 1, "loss": loss,
                  "lr": job.scheduler.get_last_lr()[0], "samples_per_s": samples_per_s,
                  **throughput(samples_per_s, flops=job.flops, tokens_per_sample=job.tokens_per_sample,
                               world_size=job.rt.world_size, peak=self.peak_flops),
                  "step_time_s": elapsed / steps, "skipped_steps": int(self.skipped_seen),
                  **(self.phases(rows, steps) if job.cfg.log.phase_times else {}), "mem": self.memory(rows)}
        straggler = self.services.interval([r.phases for r in rows], steps)
        if straggler is not None:
            record["straggler"] = straggler
        self.writer.write(record)
        self.console.status(f"loss {loss:.4f}")
        self.console.print(
            f"step {job.step:>6}/{job.plan.total_steps} | epoch {record['epoch']} | loss {loss:.4f} | "
            f"lr {record['lr']:.3e} | {record['samples_per_s']:,.0f} samples/s | {record['step_time_s']:.4f} s/step")
        self.loss_sum.zero_()
        self.loss_count.zero_()
        self.since = 0
        return stop

    def phases(self, rows: list[RankReport], steps: int) -> dict[str, Any]:
        """``phase_s`` (per rank) and ``phase_stats`` (over ranks) of the interval."""
        per_rank = {phase: [r.phases[phase] for r in rows] for phase in PHASES}
        stats = {phase: {"min": min(v), "median": statistics.median(v), "max": max(v),
                         "slowest_rank": max(range(len(v)), key=v.__getitem__)} for phase, v in per_rank.items()}
        if self.job.rt.device.type != "cuda":
            return {"phase_s": per_rank, "phase_stats": stats}
        leads = [r.lead_s for r in rows]
        step_s = statistics.median(per_rank["step"])
        if step_s > 0:
            self.lead_fracs.append(statistics.median(leads) / step_s)
        return {"phase_s": per_rank, "phase_stats": stats, "gpu_lead_s": leads}

    def memory(self, rows: list[RankReport]) -> dict[str, Any]:
        """metrics.jsonl's ``mem``: per-rank peaks, and rank 0's model state counted from the live tensors."""
        job = self.job
        peaks = [r.peak_bytes for r in rows]
        mem: dict[str, Any] = {"peak_bytes": max(peaks), "rank_peak_bytes": peaks}
        if job.state_bytes is not None:
            mem.update(job.state_bytes.as_dict())
            # On a GPU the allocator's peak is model state + activations (+ temporaries); a CPU's RSS also
            # holds the interpreter and the data, so the rest of the peak is not activations there.
            mem["activations_bytes"] = max(0, peaks[0] - job.state_bytes.model_state_bytes) \
                if job.rt.device.type == "cuda" else 0
        self.last_mem = mem
        return mem

    # -- evaluation ---------------------------------------------------------------------------------------

    def _eval_due(self) -> bool:
        job = self.job
        if job.eval_data is None:
            return False
        every = job.cfg.train.eval_every or job.plan.steps_per_epoch
        return job.step % every == 0 or job.step == job.plan.total_steps

    def _evaluate(self) -> None:
        job = self.job
        started = time.perf_counter()
        with self.preempt.saving():  # no step completes during an evaluation either: that is progress too
            metrics = evaluate(job)
        self.eval_s += time.perf_counter() - started
        self.last_eval, self.eval_step = metrics, job.step
        epoch = job.loader.epoch + 1 if job.step else 0
        self.writer.write({"kind": "eval", "step": job.step, "epoch": epoch,
                           **{f"eval_{k}": v for k, v in metrics.items()}})
        text = f"eval  @ step {job.step} (epoch {epoch}) | loss {metrics['loss']:.4f}"
        if "accuracy" in metrics:
            text += f" | accuracy {100 * metrics['accuracy']:.2f}% ({metrics['correct']:.0f}/{metrics['count']:.0f})"
        self.console.print(text)

    # -- checkpoints --------------------------------------------------------------------------------------

    def rank_state(self) -> dict[str, Any]:
        """This rank's own part of a checkpoint."""
        return {"rng": rng.capture(self.job.rt.device), "loss_sum": float(self.loss_sum.item()),
                "loss_count": float(self.loss_count.item()), "since": self.since,
                "guard": self.job.guard.state_dict()}

    def load_rank_state(self, state: dict[str, Any] | None) -> None:
        """Restore this rank's part; the RNG last, since building anything may draw from it."""
        if state is None:
            return
        self.loss_sum.fill_(state["loss_sum"])
        self.loss_count.fill_(state["loss_count"])
        # not self.since: the first interval after a resume times only the steps this process ran
        self.job.guard.load_state_dict(state["guard"])
        self.skipped_seen = float(state["guard"]["skipped"])
        if "rng" in state:
            rng.restore(state["rng"], self.job.rt.device)

    def trainer_state(self) -> dict[str, Any]:
        job = self.job
        return {"step": job.step, "loader": job.loader.state_dict(), "scheduler": scheduler_tree(job.scheduler),
                "scaler": job.scaler.state_dict() if job.scaler.is_enabled() else {},
                "train_time_s": self.train_time + self.interval_s, "last_loss": self.last_loss}

    def checkpoint_meta(self) -> dict[str, Any]:
        job = self.job
        return {"format": FORMAT_FULL, "step": job.step, "epoch": job.loader.epoch + 1, "world_size": job.rt.world_size,
                "global_batch": job.plan.global_batch, "batch_size": job.plan.batch_size,
                "accum_steps": job.plan.accum_steps, "loader": job.loader.state_dict(),
                "layout": job.layout.as_dict(),
                "config_digest": job.cfg.digest(), "config": job.cfg.to_toml(), **describe_versions()}

    def _save(self, *, final: bool) -> float:
        """Checkpoint now (every rank); returns the seconds the loop was blocked."""
        job, ckpt = self.job, self.checkpointer
        if ckpt is None:
            return 0.0
        with self.preempt.saving():
            if job.sharded:  # every rank writes its own shards through DCP
                blocked = ckpt.save_sharded(job.step, job.module, job.optimizer, self.trainer_state(),
                                            self.rank_state(), {**self.checkpoint_meta(), "format": FORMAT_DCP},
                                            background=not final)
            else:
                blocked = ckpt.save(job.step, model_tensors(job.module), optimizer_tree(job.module, job.optimizer),
                                    self.trainer_state(), self.rank_state(), self.checkpoint_meta(),
                                    background=not final)
            if final:
                ckpt.wait()
        return blocked


__all__ = ["DONE", "INTERRUPTED", "PREEMPTED", "Loop", "Tracer", "TrainingFailed", "train_step"]
