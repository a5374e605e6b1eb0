"""The step loop: micro-batches with no_sync, clip, optimizer, schedule; log and eval at their intervals.

The hot loop never waits on the device: the loss is summed into a device tensor, and it is reduced across
ranks and read back only at log steps (train.log_every).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.observe.console import Console
from scaletrain.observe.metrics import MetricsWriter
from scaletrain.train.evaluate import evaluate
from scaletrain.train.job import Job
from scaletrain.train.precision import autocast


class TrainingFailed(Exception):
    """Training cannot go on (exit code 1): a non-finite loss, say."""


def train_step(job: Job, batches: Any) -> torch.Tensor:
    """One optimizer step over accum_steps micro-batches; returns the step's mean loss on the device."""
    rt, precision = job.rt, job.cfg.train.precision
    accum = job.plan.accum_steps
    step_loss = torch.zeros((), device=rt.device)
    for micro in range(accum):
        x, y = next(batches)
        x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
        # Only the last micro-step all-reduces gradients; the others accumulate locally.
        skip_sync = micro < accum - 1 and hasattr(job.model, "no_sync")
        with job.model.no_sync() if skip_sync else contextlib.nullcontext():
            with autocast(precision, rt.device):
                loss = job.loss_fn(job.model(x), y) / accum
            job.scaler.scale(loss).backward()
        step_loss += loss.detach()
    if job.cfg.optim.grad_clip > 0:
        job.scaler.unscale_(job.optimizer)
        torch.nn.utils.clip_grad_norm_(job.module.parameters(), job.cfg.optim.grad_clip)
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    job.step += 1
    return step_loss


def _mean_over_ranks(job: Job, loss_sum: torch.Tensor, steps: int) -> float:
    if job.rt.distributed:
        dist.all_reduce(loss_sum)
    return loss_sum.item() / (steps * job.rt.world_size)  # host-device sync: log steps only


class Loop:
    """Runs job.step .. plan.total_steps; keeps the log interval's running sums."""

    def __init__(self, job: Job, console: Console, writer: MetricsWriter) -> None:
        self.job, self.console, self.writer = job, console, writer
        self.train_time = 0.0  # seconds spent in training steps (eval excluded)
        self.last_loss = math.nan
        self.last_eval: dict[str, float] = {}
        self.eval_step = -1

    def epoch_of(self, step: int) -> int:
        return step // self.job.plan.steps_per_epoch

    def run(self) -> None:
        job, plan = self.job, self.job.plan
        batches = iter(job.loader)
        job.model.train()
        if job.eval_data is not None and job.step == 0:
            self._evaluate()  # the untrained baseline, so every curve has its starting point
        self.console.start_progress(plan.total_steps, job.step)
        loss_sum = torch.zeros((), device=job.rt.device)
        since, t0 = 0, time.perf_counter()
        try:
            while job.step < plan.total_steps:
                loss_sum += train_step(job, batches)
                since += 1
                self.console.advance()
                if job.step % job.cfg.train.log_every == 0 or job.step == plan.total_steps:
                    elapsed = time.perf_counter() - t0
                    self._log(_mean_over_ranks(job, loss_sum, since), since, elapsed)
                    loss_sum.zero_()
                    since, t0 = 0, time.perf_counter()
                if self._eval_due():
                    started = time.perf_counter()
                    self._evaluate()
                    t0 += time.perf_counter() - started  # eval time is not training time
        finally:
            self.console.stop_progress()
        if job.eval_data is not None and self.eval_step != job.step:
            self._evaluate()

    def _eval_due(self) -> bool:
        job = self.job
        if job.eval_data is None:
            return False
        every = job.cfg.train.eval_every or job.plan.steps_per_epoch
        return job.step % every == 0 or job.step == job.plan.total_steps

    def _log(self, loss: float, steps: int, elapsed: float) -> None:
        job = self.job
        if not math.isfinite(loss):
            raise TrainingFailed(f"loss is {loss} at step {job.step}; fix: lower --optim.lr, set "
                                 "--optim.grad_clip=1.0, or use more warmup (--schedule.warmup_steps)")
        self.train_time += elapsed
        self.last_loss = loss
        record = {"kind": "train", "step": job.step, "epoch": self.epoch_of(job.step - 1) + 1, "loss": loss,
                  "lr": job.scheduler.get_last_lr()[0],
                  "samples_per_s": steps * job.plan.global_batch / elapsed, "step_time_s": elapsed / steps}
        self.writer.write(record)
        self.console.status(f"loss {loss:.4f}")
        self.console.print(
            f"step {job.step:>6}/{job.plan.total_steps} | epoch {record['epoch']} | loss {loss:.4f} | "
            f"lr {record['lr']:.3e} | {record['samples_per_s']:,.0f} samples/s | {record['step_time_s']:.4f} s/step")

    def _evaluate(self) -> None:
        job = self.job
        metrics = evaluate(job)
        self.last_eval, self.eval_step = metrics, job.step
        epoch = self.epoch_of(job.step - 1) + 1 if job.step else 0
        self.writer.write({"kind": "eval", "step": job.step, "epoch": epoch,
                           **{f"eval_{k}": v for k, v in metrics.items()}})
        text = f"eval  @ step {job.step} (epoch {epoch}) | loss {metrics['loss']:.4f}"
        if "accuracy" in metrics:
            text += f" | accuracy {100 * metrics['accuracy']:.2f}% ({metrics['correct']:.0f}/{metrics['count']:.0f})"
        self.console.print(text)

